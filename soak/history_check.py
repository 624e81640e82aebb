"""The soak's check of a history table (docs/history.md) against the source as of sampled past LSNs.

While the workload is paused between two of its transactions (it is the only writer of its tables,
and sequential), :func:`take_sample` records ``pg_current_wal_insert_lsn()`` (past the last commit
record) and the table's rows as the policy leaves them (soak/policy_check.py's expectation: filtered
rows, masked values by the check's own HMAC, left-out columns absent). At the end,
:func:`history_divergences` runs the history's as-of query (``iceberg.history.as_of``) at each
sample's LSN and compares its rows with the sample's row by row, on the sample's columns only (not the
history's own columns, nor columns added after the sample); and over the whole history table no key
has two current versions and no version is written twice.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import psycopg
from pyiceberg.table import Table

from pg2iceberg_dagster.iceberg.history import HistoryColumns, as_of

from .policy_check import EXAMPLES, Policy, expected_rows

# Long values (TOAST-sized text) are cut to this many characters in a report.
SHOWN_CHARS = 40


@dataclass(frozen=True)
class Sample:
    """The table as of ``lsn``: its rows by key, each the values of ``columns`` (the key first)."""

    number: int
    lsn: int
    columns: list[str]
    width: int
    rows: dict[tuple[Any, ...], tuple[Any, ...]]


def take_sample(writer: psycopg.Connection, conninfo: str, policy: Policy, secret: bytes, number: int) -> Sample:
    """The table of ``policy`` now, with the WAL insert position. ``writer`` is the only connection that
    writes the table, idle between two transactions (autocommit): no commit can fall between the rows
    read and the position."""
    rows = expected_rows(conninfo, policy, secret)
    found = writer.execute("SELECT (pg_current_wal_insert_lsn() - '0/0')::bigint").fetchone()
    assert found is not None
    return Sample(number, int(found[0]), list(policy.mirrored), len(policy.key), rows)


class SampleLog:
    """A scenario's samples of its tables with a history, kept only while the history will hold every
    version up to them. A gap (the snapshot running, a lost slot until its repair and resyncs are done, a
    table taken out of the config until its snapshot in a new epoch completes) stops the sampling; at its
    start the samples not yet merged are dropped: a repair or resync skips the staged changes it finds
    unmerged, and their versions never reach the history."""

    def __init__(self, tables: list[str]) -> None:
        self.samples: dict[str, list[Sample]] = {table: [] for table in tables}
        self.gaps: set[str] = {"snapshot"}
        self.taken = 0
        self._staged = {table: 0 for table in tables}
        self._merged = {table: 0 for table in tables}

    def take(self, writer: psycopg.Connection, conninfo: str, policies: dict[str, Policy], secret: bytes) -> None:
        """A sample of every table (see :func:`take_sample`), unless in a gap."""
        if self.gaps:
            return
        for table, samples in self.samples.items():
            self.taken += 1
            samples.append(take_sample(writer, conninfo, policies[table], secret, self.taken))

    def staged(self) -> None:
        """Every change so far is staged (a ``stream`` stopped cleanly, flushing what it buffered)."""
        self._staged = {table: len(samples) for table, samples in self.samples.items()}

    def merged(self, resynced: set[str]) -> None:
        """What was staged is merged, but for the tables in ``resynced`` (copied again: their samples
        since their last merge are dropped)."""
        for table in self.samples:
            if table in resynced:
                del self.samples[table][self._merged[table] :]
                self._staged[table] = self._merged[table]
            else:
                self._merged[table] = self._staged[table]

    def open_gap(self, reason: str) -> None:
        """Stop sampling until :meth:`close_gap` (``reason``), dropping the samples not merged."""
        self.gaps.add(reason)
        self.merged(resynced=set(self.samples))

    def close_gap(self, reason: str) -> None:
        self.gaps.discard(reason)


def _shown(value: Any) -> Any:
    if isinstance(value, str | bytes) and len(value) > SHOWN_CHARS:
        return f"{value[:SHOWN_CHARS]!r}... ({len(value)} long)"
    return value if value is None or isinstance(value, int | float | bool) else str(value)


def _sample_divergence(history: Table, sample: Sample) -> dict[str, Any] | None:
    """How the history's as-of rows at the sample's LSN differ from the sample's rows (None: equal)."""
    rows = history.scan(row_filter=as_of(history, sample.lsn)).to_arrow().to_pylist()
    got: dict[tuple[Any, ...], tuple[Any, ...]] = {}
    for row in rows:
        values = tuple(row.get(name) for name in sample.columns)
        got[values[: sample.width]] = values
    only_source = sorted(set(sample.rows) - set(got))
    only_history = sorted(set(got) - set(sample.rows))
    different = sorted(key for key in set(got) & set(sample.rows) if got[key] != sample.rows[key])
    if not (only_source or only_history or different or len(rows) != len(got)):
        return None
    examples: list[dict[str, Any]] = [{"key": str(key), "only_in_source": True} for key in only_source[:EXAMPLES]]
    examples += [{"key": str(key), "only_in_history": True} for key in only_history[:EXAMPLES]]
    for key in different[:EXAMPLES]:
        pairs = zip(sample.columns, got[key], sample.rows[key], strict=True)
        differing = {name: {"history": _shown(ours), "source": _shown(theirs)} for name, ours, theirs in pairs}
        examples.append({"key": str(key), **{k: v for k, v in differing.items() if v["history"] != v["source"]}})
    return {
        "sample": sample.number,
        "lsn": sample.lsn,
        "rows_at_source": len(sample.rows),
        "rows_as_of": len(rows),
        "only_in_source": len(only_source),
        "only_in_history": len(only_history),
        "differences": len(different),
        "examples": examples,
    }


def history_divergences(history: Table, samples: list[Sample], key: list[str], seed: int) -> list[dict[str, Any]]:
    """How the history table ``history`` (of a table keyed by ``key``) fails to reproduce the source as of
    every sample, and versions it holds twice or keys with two current versions (empty: exact)."""
    own = HistoryColumns.recorded(history)
    found: list[dict[str, Any]] = []
    table = ".".join(history.name())
    versions = history.scan().to_arrow().to_pylist()
    current = Counter(tuple(row[name] for name in key) for row in versions if row[own.current])
    twice_current = [str(k) for k, count in current.items() if count > 1]
    # Several changes of a key in one transaction give versions valid from and to one LSN, which may be
    # equal (an update of excluded columns only); any other version is one row of its own.
    lasting = Counter(tuple(row.values()) for row in versions if row[own.valid_to_lsn] != row[own.valid_from_lsn])
    repeated = [[_shown(v) for v in version] for version, count in lasting.items() if count > 1]
    if twice_current or repeated:
        found.append(
            {
                "table": table,
                "seed": seed,
                "keys_with_two_current_versions": twice_current[:EXAMPLES],
                "versions_written_twice": repeated[:EXAMPLES],
            }
        )
    for sample in samples:
        divergence = _sample_divergence(history, sample)
        if divergence is not None:
            found.append({"table": table, "seed": seed, "check": "history as of sample", **divergence})
    return found
