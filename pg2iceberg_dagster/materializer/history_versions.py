"""The versions a batch of staged changes adds to a history table (docs/history.md).

Unlike the fold, every change is a version: the changes of one key chain in log order (commit order),
each version valid from its change's commit LSN to the next change's. A DELETE closes the key's
version (it writes none); a key change is the delete of the old key and the insert of the new one; a
TRUNCATE closes every open version. The history rows current before the batch are closed by the first
change of their key (or the batch's first TRUNCATE, whichever comes first). An unchanged TOAST value
is taken from the key's previous version in the batch, or else from its current history row (the old
key's, after a key change): ``FoldedRow.fill_from_key`` names that key.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime

import pyarrow as pa

from ..iceberg.history import INSERT as INSERTED
from ..iceberg.history import UPDATE as UPDATED
from ..staging.codec import DELETE, INSERT, TRUNCATE, StagedRelation, changes_of
from .fold import UPSERT, FoldedRow, Key, carry_unchanged, is_key_change


@dataclass
class Version:
    """One version of a row: its values (``row``), what wrote it and until when it was valid."""

    key: Key
    row: FoldedRow
    operation: str
    valid_to_lsn: int | None = None
    valid_to_at: datetime | None = None


@dataclass(frozen=True)
class Closing:
    """The history row of ``key`` current before the batch ends at this commit LSN and time."""

    key: Key
    lsn: int
    at: datetime | None
    relation: StagedRelation | None = None  # the key's values are typed by its columns


@dataclass
class BatchVersions:
    versions: list[Version] = field(default_factory=list)
    closings: list[Closing] = field(default_factory=list)
    # The batch's first TRUNCATE: every history row current before the batch and not closed by a
    # change of its key before it ends there.
    truncated: Closing | None = None


def batch_versions(staged: Iterable[tuple[StagedRelation, pa.Table]], key_names: list[str]) -> BatchVersions:
    """The versions of the staged changes (aligned to the table's columns, in log order)."""
    result = BatchVersions()
    open_versions: dict[Key, Version] = {}
    touched: set[Key] = set()
    # The last DELETE (see fold.is_key_change).
    last_delete: tuple[int, Key, Version | None] | None = None
    for relation, table in staged:
        for change in changes_of(table):
            if change.op == TRUNCATE:
                for version in open_versions.values():
                    version.valid_to_lsn, version.valid_to_at = change.commit_lsn, change.ts
                open_versions.clear()
                if result.truncated is None:
                    result.truncated = Closing((), change.commit_lsn, change.ts)
                continue
            key = tuple(change.data[name] for name in key_names)
            if key not in touched:
                touched.add(key)
                if result.truncated is None:
                    result.closings.append(Closing(key, change.commit_lsn, change.ts, relation))
            previous = open_versions.pop(key, None)
            if previous is not None:
                previous.valid_to_lsn, previous.valid_to_at = change.commit_lsn, change.ts
            if change.op == DELETE:
                last_delete = (change.lsn, key, previous)
                continue
            moved = last_delete is not None and is_key_change(last_delete[:2], change, key)
            source, fill_from = previous, key
            if moved and last_delete is not None:
                fill_from, source = last_delete[1], last_delete[2]
            data = dict(change.data)
            unchanged = set(change.unchanged)
            if unchanged and source is not None:
                carry_unchanged(data, unchanged, source.row.data)
                fill_from = source.row.fill_from_key or source.key
            row = FoldedRow(
                UPSERT,
                data,
                frozenset(unchanged),
                relation,
                fill_from,
                commit_lsn=change.commit_lsn,
                committed_at=change.ts,
            )
            operation = INSERTED if change.op == INSERT or moved else UPDATED
            version = Version(key, row, operation)
            result.versions.append(version)
            open_versions[key] = version
    return result
