"""Consistent cuts: every table of a group complete up to one source LSN L, tagged with one name.

How a cut is taken (docs/cuts.md gives the argument):
1. Hold the writer lease of every table of the group, in name order (merges and maintenance take one
   lease at a time, so waiting for them cannot deadlock). No merge moves a table while the cut holds it.
2. Read ``flushed_lsn`` L and every table's log head in one statement. A flush registers its files and
   moves ``flushed_lsn`` in one transaction, so L is a transaction boundary the flusher staged
   completely, and each table's log up to its head holds exactly the changes of the transactions
   committed at or before L. No table was merged past its head: merges only read what was registered.
   L must be past the snapshot each table was last copied under (its epoch's ``lsn_bound``), or the
   copy may show later transactions: the cut waits for the flusher to get there.
3. Merge each table up to its head and no further; a table already at its head is complete up to L
   at its current snapshot (nothing staged after L was merged, since the leases came first).
4. Tag each table's current snapshot with the cut's name, recording the cut (L, time, tables, group)
   in a table property ``pg2iceberg.cut.<name>`` beside it: one Iceberg commit per table.
5. Drop the group's cuts beyond ``cuts.keep`` or older than ``cuts.max_age_hours`` (and any cut whose
   tagging a crash left unfinished), still under the leases.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from pyiceberg.catalog import Catalog
from pyiceberg.table import Table
from pyiceberg.table.refs import SnapshotRefType
from pyiceberg.table.update.snapshot import ManageSnapshots

from .config import CutsConfig
from .coordination.protocol import LEASE_RETRY_SECONDS, LEASE_WAIT_SECONDS, writer_lease_within
from .coordination.store import CoordinationStore
from .errors import ConfigError, CutError
from .iceberg.commit import commit_with_retry
from .iceberg.transaction import open_transaction
from .materializer.branch import MERGE_BRANCH
from .materializer.merge import Materializer
from .source.lsn import format_lsn, parse_lsn
from .tables import MirroredTables

CUT_PROPERTY_PREFIX = "pg2iceberg.cut."
# A tag name Spark's VERSION AS OF reads as a ref, never as a snapshot id (all digits), and that
# Trino, DuckDB and shells take without quoting trouble.
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]{0,99}$")
# How long a cut waits for the flusher to stage past a table's latest copy (see _staged_past_snapshots).
STAGED_WAIT_SECONDS = 120.0


@dataclass(frozen=True)
class Cut:
    """A cut: ``tables`` tagged ``name``, each complete up to source LSN ``lsn``."""

    name: str
    lsn: int
    taken_at: datetime
    tables: tuple[str, ...]
    group: str | None = None
    # Each table's tagged snapshot (read from its tag; empty for a cut described but not read).
    snapshots: dict[str, int] = field(default_factory=dict, compare=False)

    @property
    def complete(self) -> bool:
        """Every table of the cut carries its tag (a crash while tagging leaves a cut incomplete)."""
        return set(self.snapshots) == set(self.tables)

    def record(self) -> str:
        """The table property value that describes the cut."""
        return json.dumps(
            {
                "lsn": format_lsn(self.lsn),
                "taken_at": self.taken_at.isoformat(),
                "tables": list(self.tables),
                "group": self.group,
            }
        )

    def as_json(self) -> dict[str, Any]:
        """The cut as ``cut --json`` and ``status --json`` print it."""
        return {
            "name": self.name,
            "lsn": format_lsn(self.lsn),
            "taken_at": self.taken_at.isoformat(),
            "group": self.group,
            "tables": list(self.tables),
            "snapshots": {key: str(snapshot) for key, snapshot in self.snapshots.items()},
        }


def cut_tables(tables: MirroredTables, cuts: CutsConfig, group: str | None) -> list[str]:
    """The keys of the tables a cut of ``group`` takes (every mirrored table without one), in name order."""
    if group is None:
        return sorted(tables)
    if group not in cuts.groups:
        known = ", ".join(sorted(cuts.groups)) or "none"
        raise CutError(f"cut group {group!r} is not configured (cuts.groups has: {known}); add it to cuts.groups")
    keys, missing = set(), []
    for name in cuts.groups[group]:
        try:
            keys.add(tables.named(name).key)
        except ConfigError:
            missing.append(name)
    if missing:
        raise CutError(
            f"cut group {group!r} names {', '.join(missing)}, not mirrored by this pipeline: add them to tables: "
            "or remove them from the group"
        )
    return sorted(keys)


def default_cut_name(now: datetime) -> str:
    """``cut-20261127T140301Z``: sortable, readable and unique per second."""
    return f"cut-{now:%Y%m%dT%H%M%SZ}"


def _refuse_bad_name(name: str, catalog: Catalog, tables: MirroredTables, keys: list[str]) -> None:
    """Before anything is merged: the name is a valid tag no table of the cut already has."""
    if not _NAME.match(name) or name in ("main", MERGE_BRANCH):
        raise CutError(
            f"cut name {name!r} is not usable as an Iceberg tag: start with a letter, then letters, digits, "
            "'_', '.', '-' (at most 100), and not 'main'; pass another with --name"
        )
    taken = [key for key in keys if name in catalog.load_table(tables[key].iceberg).metadata.refs]
    if taken:
        raise CutError(
            f"cut name {name!r} is already a tag or branch of {', '.join(taken)}: pass another with --name "
            "(`status` lists the latest cut)"
        )


def _refuse_unmergeable(store: CoordinationStore, keys: list[str]) -> None:
    """A table whose snapshot is not complete, or that waits for a resync, cannot be brought up to L."""
    states = store.table_states()
    waiting = []
    for key in keys:
        state = states.get(key)
        if state is None or not state.snapshot_complete:
            waiting.append(f"{key} (snapshot not complete: `snapshot` or `run` takes it)")
        elif state.resync_reason is not None:
            waiting.append(f"{key} (waits for a resync: {state.resync_reason}; `resync --table {key}` runs it)")
    if waiting:
        raise CutError(f"cannot cut: {'; '.join(waiting)}. Nothing was tagged; cut again once they are done")


def take_cut(
    materializer: Materializer,
    store: CoordinationStore,
    catalog: Catalog,
    cuts: CutsConfig,
    name: str | None = None,
    group: str | None = None,
) -> Cut:
    """Bring every table of ``group`` (all, without one) up to one common source LSN, tag each at it
    with ``name`` (by default after the time), and drop cuts past retention; returns the cut."""
    tables = materializer.tables
    keys = cut_tables(tables, cuts, group)
    now = datetime.now(UTC)
    name = name or default_cut_name(now)
    _refuse_unmergeable(store, keys)
    _refuse_bad_name(name, catalog, tables, keys)
    with contextlib.ExitStack() as leases:
        for key in keys:  # name order: see the module's docstring
            leases.enter_context(
                writer_lease_within(store, materializer.group, key, materializer.worker_id, LEASE_WAIT_SECONDS)
            )
        lsn, heads = _staged_past_snapshots(store, keys)
        merged = {key: _merged(materializer, catalog, key, heads[key], lsn) for key in keys}
        cut = Cut(name, lsn, now, tuple(keys), group, {key: snapshot for key, (_, snapshot) in merged.items()})
        for table, snapshot_id in merged.values():
            _tag(table, cut, snapshot_id)
        expire_cuts(catalog, tables, keys, cuts, group, now)
    return cut


def _staged_past_snapshots(store: CoordinationStore, keys: list[str]) -> tuple[int, dict[str, int]]:
    """``flushed_lsn`` L and the tables' log heads (see StagedLogStore.staged_positions), once L is past
    the position of every snapshot the tables' rows were read under: a table copied (resynced) under a
    snapshot taken after L may show transactions committed after L, which no replay takes away. The
    flusher does not wait for the leases the caller holds; this waits for it, up to a while."""
    states = store.table_states()
    epochs = {state.snapshot_epoch for key in keys if (state := states.get(key)) and state.snapshot_epoch is not None}
    bound = max((store.snapshot_epoch(epoch).lsn_bound for epoch in epochs), default=0)
    deadline = time.monotonic() + STAGED_WAIT_SECONDS
    while True:
        lsn, heads = store.staged_positions(keys)
        if lsn is None:
            raise CutError("cannot cut before the replication slot exists: run `snapshot` (or `run`) first")
        if lsn >= bound:
            return lsn, heads
        if time.monotonic() >= deadline:
            raise CutError(
                f"cannot cut: the flusher has staged up to {format_lsn(lsn)}, not yet up to {format_lsn(bound)} where "
                "a table of the cut was last copied; run `stream` (or `run`) and cut again once it caught up"
            )
        time.sleep(LEASE_RETRY_SECONDS)


def _merged(materializer: Materializer, catalog: Catalog, key: str, head: int, lsn: int) -> tuple[Table, int]:
    """Merge the table up to ``head`` (complete up to ``lsn``); the Iceberg table and its snapshot then."""
    result = materializer.merge_to(key, head, lsn)
    if result.not_current is not None or result.lag.mat_cursor != head:
        reason = result.not_current or f"its cursor stands at {result.lag.mat_cursor}, not {head}"
        raise CutError(f"cannot cut: {key} could not be merged up to {format_lsn(lsn)}: {reason}. Nothing was tagged")
    table = catalog.load_table(materializer.tables[key].iceberg)
    snapshot = table.current_snapshot()
    if snapshot is None:
        raise CutError(f"cannot cut: {key} has no Iceberg snapshot yet; `snapshot` (or `run`) writes it first")
    return table, snapshot.snapshot_id


def _tag(table: Table, cut: Cut, snapshot_id: int) -> None:
    """Tag ``snapshot_id`` with the cut's name and record the cut, in one commit."""

    def commit() -> None:
        table.refresh()
        with open_transaction(table) as transaction:
            transaction.set_properties({CUT_PROPERTY_PREFIX + cut.name: cut.record()})
            with ManageSnapshots(transaction) as refs:
                refs.create_tag(snapshot_id, cut.name)

    commit_with_retry(commit)


def _untag(table: Table, name: str) -> None:
    """Remove the cut's tag and record from the table (each only if there)."""

    def commit() -> None:
        table.refresh()
        with open_transaction(table) as transaction:
            if CUT_PROPERTY_PREFIX + name in table.properties:
                transaction.remove_properties(CUT_PROPERTY_PREFIX + name)
            ref = table.metadata.refs.get(name)
            if ref is not None and ref.snapshot_ref_type == SnapshotRefType.TAG:
                with ManageSnapshots(transaction) as refs:
                    refs.remove_tag(name)

    commit_with_retry(commit)


def list_cuts(catalog: Catalog, tables: MirroredTables, keys: Iterable[str]) -> list[Cut]:
    """The cuts recorded on the tables ``keys``, newest first, each with the tables found tagged."""
    found: dict[str, Cut] = {}
    for key in keys:
        table = catalog.load_table(tables[key].iceberg)
        for prop, value in table.properties.items():
            if not prop.startswith(CUT_PROPERTY_PREFIX):
                continue
            name = prop.removeprefix(CUT_PROPERTY_PREFIX)
            if name not in found:
                record = json.loads(value)
                found[name] = Cut(
                    name,
                    parse_lsn(record["lsn"]),
                    datetime.fromisoformat(record["taken_at"]),
                    tuple(record["tables"]),
                    record.get("group"),
                )
            ref = table.metadata.refs.get(name)
            if ref is not None and ref.snapshot_ref_type == SnapshotRefType.TAG:
                found[name].snapshots[key] = ref.snapshot_id
    return sorted(found.values(), key=lambda cut: cut.taken_at, reverse=True)


def latest_cut(catalog: Catalog, tables: MirroredTables) -> Cut | None:
    """The newest complete cut over the mirrored tables (None when there is none)."""
    return next((cut for cut in list_cuts(catalog, tables, sorted(tables)) if cut.complete), None)


def expire_cuts(
    catalog: Catalog, tables: MirroredTables, keys: list[str], cuts: CutsConfig, group: str | None, now: datetime
) -> list[str]:
    """Drop ``group``'s cuts past retention (the newest ``cuts.keep``, younger than ``cuts.max_age_hours``)
    and incomplete ones, from the tables ``keys`` whose leases the caller holds; returns their names."""
    oldest = now - timedelta(hours=cuts.max_age_hours) if cuts.max_age_hours is not None else None
    kept = 0
    expired = []
    for cut in list_cuts(catalog, tables, keys):
        if cut.group != group:
            continue
        if cut.complete and kept < cuts.keep and (oldest is None or cut.taken_at >= oldest):
            kept += 1
            continue
        expired.append(cut.name)
        for key in cut.tables:
            if key in tables:
                _untag(catalog.load_table(tables[key].iceberg), cut.name)
    return expired
