"""Data checks on a mirrored table: one row per primary key, a schema that matches the source, and
content equal to the source at a consistent point (:class:`TableChecker` runs them over tables)."""

from __future__ import annotations

import functools
import itertools
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass

import psycopg
import pyarrow.compute as pc
from pyiceberg.catalog import Catalog
from pyiceberg.expressions import AlwaysTrue, BooleanExpression
from pyiceberg.table import Table

from .config import OutOfRange, PipelineConfig
from .coordination.records import Lag, TableState
from .coordination.store import CoordinationStore
from .errors import StagingError
from .iceberg.evolution import schema_follows_source
from .maintenance.health import summary_health
from .materializer.lanes import LaneConnections, on_lanes
from .materializer.merge import replay_epoch, staged_changes
from .source.catalog import SourceTable, TypeResolver, describe_table
from .source.connection import consistent_read
from .source.lsn import format_lsn, parse_lsn
from .source.xid_snapshot import XidSnapshot
from .staging.codec import TRUNCATE
from .staging.store import ObjectStore
from .tables import MirroredTables
from .verify import KeySlice, TableDiff, choose_key_slice, compare_table, sliceable, typed_keys

# Differing keys a content check keeps to account for one by one (a key is about a hundred bytes):
# past this, a kept key no change explains still fails the check, but all kept explained is not a pass.
DIFFERING_KEYS_KEPT = 100_000
# A content check whose differences the staged log does not all explain waits this long at most for
# the flusher to stage up to the comparison's WAL position (only then is an unexplained one conclusive).
IN_FLIGHT_WAIT_SECONDS = 10.0

ALL_ROWS = "all rows"


@dataclass(frozen=True)
class ContentCheck:
    """Rows compared with the source, every difference accounted for.

    The Iceberg table is compared as merged up to ``merged_lsn`` (at least) with the source's
    consistent snapshot at ``source_lsn``. A difference on a key is *explained* when the staged log
    holds a change of that key past the merge cursor that the source snapshot sees: committed after
    the merge position and by the snapshot, not in Iceberg yet. Every difference explained passes;
    one that is not fails (``unexplained``); when that cannot be told, ``inconclusive`` says why.
    """

    lag: int  # staged changes not merged yet when the table was compared
    diff: TableDiff | None = None  # None when not compared
    merged_lsn: int | None = None
    source_lsn: int | None = None
    explained: int = 0  # differing keys a staged change committed after merged_lsn, by source_lsn, explains
    unexplained: int = 0  # differences nothing explains (duplicate keys in Iceberg included)
    unexplained_examples: tuple[tuple, ...] = ()
    inconclusive: str = ""  # why the rows' equality could not be told either way (else empty)

    @property
    def merged_lsn_text(self) -> str:
        """``merged_lsn`` as PostgreSQL writes LSNs ("none" before any merge)."""
        return format_lsn(self.merged_lsn) if self.merged_lsn else "none"

    @property
    def source_lsn_text(self) -> str:
        """``source_lsn`` as PostgreSQL writes LSNs ("none" when not compared)."""
        return format_lsn(self.source_lsn) if self.source_lsn else "none"

    @property
    def failed(self) -> bool:
        """A difference no change explains: the mirror holds what the source never had."""
        return self.unexplained > 0

    @property
    def passed(self) -> bool:
        """Compared, and every difference (if any) explained by a change not merged yet."""
        return self.diff is not None and not self.failed and not self.inconclusive

    @property
    def conclusive(self) -> bool:
        """Whether the check passed or failed (else it could not tell: ``inconclusive``)."""
        return self.passed or self.failed


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


def _not_mergeable(state: TableState | None, table_key: str) -> str:
    """Why the table's rows cannot be compared with the source's (its staged changes do not apply to
    them), or ''."""
    if state is None or not state.snapshot_complete:
        return "its snapshot is not complete yet: `snapshot` (or the chunk partitions) takes it"
    if state.resync_reason:
        return f"it waits for an online resync ({state.resync_reason}): `pg2iceberg-dagster resync --table {table_key}`"
    return ""


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
    """A table checked and compared with the source: its differences are accounted for afterwards,
    against the staged log."""

    duplicates: tuple[int, list[tuple]]
    schema_problems: list[str]
    scope: _CheckScope
    diff: TableDiff
    source: SourceTable
    table: Table  # the Iceberg table as compared
    lag: Lag  # read before the Iceberg table was loaded: the table holds every change before its cursor
    wal: int  # the source's WAL position as the comparison's snapshot was taken
    snapshot: XidSnapshot  # the transactions the comparison's snapshot of the source sees

    def report(self, unexplained: list[tuple], inconclusive: str = "") -> TableCheckReport:
        """The report once the kept differing keys are accounted for: ``unexplained`` of them no
        staged change explains, a failure unless ``inconclusive`` says why that is not known yet."""
        diff = self.diff
        if not inconclusive and not unexplained and diff.differences > len(diff.differing_keys):
            inconclusive = (
                f"{diff.differences:,} differences, more than the {len(diff.differing_keys):,} kept to account for "
                "one by one (all of those are explained by changes not merged yet)"
            )
        failing = [] if inconclusive else unexplained
        content = ContentCheck(
            self.lag.changes,
            diff,
            self.lag.merged_lsn,
            self.wal,
            explained=len(diff.differing_keys) - len(unexplained),
            # No change explains a duplicate key, whatever the flusher has staged.
            unexplained=len(failing) + diff.duplicate_keys,
            unexplained_examples=tuple(failing[:5]),
            inconclusive=inconclusive,
        )
        return self.scope.report(self.duplicates, self.schema_problems, content)


class TableChecker:
    """Runs the data checks over tables with a pipeline's parts (its tables, coordination store,
    staged files and catalog; each lane its own connections)."""

    def __init__(
        self,
        config: PipelineConfig,
        tables: MirroredTables,
        store: CoordinationStore,
        objects: ObjectStore,
        catalog: Catalog,
    ) -> None:
        self.config = config
        self.tables = tables
        self.store = store
        self.objects = objects
        self.catalog = catalog

    def check_tables(self, table_keys: list[str]) -> Iterator[tuple[str, TableCheckReport | Exception]]:
        """Per table, as each is done (or the error that stopped its checks): one row per primary key;
        the schema follows the source's columns as they are now; the rows equal the source's, every
        difference explained by a change not merged yet (see :class:`ContentCheck`), lag or not.
        Tables are checked ``materialize.parallelism`` at a time; those with a difference the staged
        log does not explain yet share one wait for the flusher to stage up to their comparisons."""
        waiting: list[tuple[str, _Compared, list[tuple]]] = []
        count = max(1, min(self.config.materialize.parallelism, len(table_keys)))
        open_lane = functools.partial(LaneConnections.open, self.config)
        for key, outcome in on_lanes(table_keys, count, open_lane, LaneConnections.close, self._check_table):
            if not isinstance(outcome, _Compared):
                yield key, outcome
                continue
            try:
                flushed = self.store.flushed_lsn() or 0  # before the staged log is read: what it holds
                unexplained, unreadable = self._unexplained(key, outcome)
            except Exception as exc:  # reported as this table's error; the others are still checked
                yield key, exc
                continue
            if unexplained and not unreadable and flushed < outcome.wal:
                waiting.append((key, outcome, unexplained))  # a change not staged yet may explain them
            else:
                yield key, outcome.report(unexplained, unreadable)
        if not waiting:
            return
        flushed = self._flushed_past(max(compared.wal for _, compared, _ in waiting))
        for key, compared, unexplained in waiting:
            if flushed < compared.wal:
                behind = (
                    f"the flusher had not staged up to the comparison's WAL position {format_lsn(compared.wal)} "
                    f"within {IN_FLIGHT_WAIT_SECONDS:g} s (it stood at {format_lsn(flushed)}): "
                    f"{len(unexplained):,} differences may still be changes not staged yet"
                )
                yield key, compared.report(unexplained, behind)
                continue
            try:
                yield key, compared.report(*self._unexplained(key, compared))
            except Exception as exc:
                yield key, exc

    def _flushed_past(self, lsn: int) -> int:
        """The flushed LSN, once it is at or past ``lsn`` or after :data:`IN_FLIGHT_WAIT_SECONDS`."""
        deadline = time.monotonic() + IN_FLIGHT_WAIT_SECONDS
        while True:
            flushed = self.store.flushed_lsn() or 0
            if flushed >= lsn or time.monotonic() >= deadline:
                return flushed
            time.sleep(0.5)

    def _unexplained(self, table_key: str, compared: _Compared) -> tuple[list[tuple], str]:
        """The kept differing keys that no change staged now explains: a change past the merge cursor
        the comparison's source snapshot sees (read as merges read the staged log); and why those
        changes could not all be read ('' when they were)."""
        pending = set(compared.diff.differing_keys)
        if not pending:
            return [], ""
        cursor = compared.lag.mat_cursor
        entries = self.store.log_entries(table_key, cursor)
        if (entries[0].start_offset if entries else self.store.log_head(table_key)) > cursor:
            return compared.diff.differing_keys, (
                f"the staged changes from offset {cursor:,} on, which the comparison needs, are gone "
                "(merged and cleaned up since)"
            )
        # Offsets follow commit order: an entry that starts past the comparison's WAL position holds
        # no change its snapshot sees.
        window = list(itertools.takewhile(lambda entry: entry.first_lsn <= compared.wal, entries))
        key = compared.source.primary_key
        try:
            for _, changes in staged_changes(self.objects, window, cursor, replay_epoch(self.store, table_key)):
                seen = changes.filter(compared.snapshot.visible(changes.column("_xid")))
                if pc.any(pc.equal(seen.column("_op"), TRUNCATE)).as_py():
                    return [], ""  # the table emptied: every difference may come from that
                texts = [[row.get(name) for name in key] for row in map(json.loads, seen.column("_data").to_pylist())]
                pending.difference_update(typed_keys(compared.source, compared.table, self.rule, texts))
                if not pending:
                    break
        except StagingError as exc:
            return compared.diff.differing_keys, f"a staged file the comparison needs could not be read: {exc}"
        return [k for k in compared.diff.differing_keys if k in pending], ""

    @property
    def rule(self) -> OutOfRange:
        """How values Iceberg cannot hold are mapped (the comparison maps the source's alike)."""
        return self.config.values.out_of_range

    def _check_table(self, lane: LaneConnections, table_key: str) -> TableCheckReport | _Compared:
        """One table's checks (see :meth:`check_tables`); a comparison's differences are accounted
        for afterwards."""
        conn = lane.source()
        source = describe_table(
            conn, self.tables[table_key].config, TypeResolver(conn), self.config.replication.publication
        )
        # The merge position before the table: the cursor moves only after the Iceberg commit, so the
        # table loaded next holds every change before it (and maybe some after).
        lag = lane.store.lag(self.config.materialize.group, table_key)
        table = self.catalog.load_table(self.tables[table_key].iceberg)
        problems = schema_mismatches(source, table)
        scope = self._check_scope(conn, source, table)
        duplicates = duplicate_keys(table, scope.keys_filter())
        not_compared = _not_mergeable(lane.store.table_state(table_key), table_key) or scope.not_compared
        if not_compared:
            content = ContentCheck(lag.changes, merged_lsn=lag.merged_lsn, inconclusive=not_compared)
            return scope.report(duplicates, problems, content)
        with consistent_read(conn):
            # The transaction's first query: its snapshot is taken here, and every transaction it
            # sees committed before this WAL insert position (so did every change merged above).
            row = conn.execute("SELECT pg_current_wal_insert_lsn()::text, pg_current_snapshot()::text").fetchone()
            assert row is not None
            wal, snapshot = parse_lsn(row[0]), XidSnapshot.parse(row[1])
            diff = compare_table(
                conn, source, table, self.rule, key_slice=scope.key_slice, keep_keys=DIFFERING_KEYS_KEPT
            )
        return _Compared(duplicates, problems, scope, diff, source, table, lag, wal, snapshot)

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
