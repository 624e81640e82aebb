"""Folding a batch of staged changes to at most one change per primary key (last change wins).

Changes arrive in log order (the order the flusher registered them, i.e. commit order, and the
order inside each transaction). Folding keeps, per key, the last change; an update whose TOASTed
columns were unchanged takes them from an earlier change in the batch when there is one, and
otherwise leaves them to be filled from the current Iceberg row during the MERGE. A TRUNCATE
discards everything folded before it and makes the merge start by emptying the table.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from ..staging.codec import DELETE, TRUNCATE, Change, StagedRelation

UPSERT = "U"


@dataclass
class FoldedRow:
    """The net effect on one key: an upsert of ``data`` (minus ``unchanged`` columns) or a delete."""

    op: str
    data: dict[str, str | None]
    unchanged: frozenset[str] = frozenset()
    relation: StagedRelation | None = None
    # After a primary-key change, unchanged columns come from the row under this (old) key.
    fill_from_key: tuple[str | None, ...] | None = None
    # Typed values already looked up for unchanged columns (see materializer.merge).
    filled: dict[str, object] = field(default_factory=dict)
    # The last change's commit LSN and source commit time (see staging.codec.COMMIT_LSN_COLUMN).
    commit_lsn: int = 0
    committed_at: datetime | None = None


@dataclass
class FoldResult:
    truncated: bool = False
    # The last TRUNCATE's commit LSN and commit time (a soft-deleting table marks its rows with them).
    truncated_lsn: int = 0
    truncated_at: datetime | None = None
    rows: dict[tuple[str | None, ...], FoldedRow] = field(default_factory=dict)
    changes: int = 0
    relations: list[StagedRelation] = field(default_factory=list)


def fold(batches: Iterable[tuple[StagedRelation, Sequence[Change]]], primary_key: Sequence[str]) -> FoldResult:
    """Fold staged files (in log order) into the net change per primary key."""
    result = FoldResult()
    last_delete: tuple[int, tuple[str | None, ...], FoldedRow | None] | None = None
    for relation, changes in batches:
        if relation not in result.relations:
            result.relations.append(relation)
        for change in changes:
            result.changes += 1
            if change.op == TRUNCATE:
                result.rows.clear()
                result.truncated = True
                result.truncated_lsn, result.truncated_at = change.commit_lsn, change.ts
                continue
            key = tuple(change.data[name] for name in primary_key)
            if change.op == DELETE:
                last_delete = (change.lsn, key, result.rows.get(key))
                result.rows[key] = FoldedRow(
                    DELETE, dict(change.data), relation=relation, commit_lsn=change.commit_lsn, committed_at=change.ts
                )
                continue
            data = dict(change.data)
            # Columns of the Iceberg table that this change does not carry keep their current value.
            unchanged = set(change.unchanged)
            previous = result.rows.get(key)
            fill_from_key = None
            if last_delete is not None and last_delete[0] == change.lsn and last_delete[1] != key:
                # The flusher stages a key-changing UPDATE as DELETE(old key) + UPDATE at one LSN: the
                # unchanged columns belong to the old key's row.
                old_key, previous = last_delete[1], last_delete[2]
                fill_from_key = old_key
                if previous is not None and previous.op == UPSERT and previous.fill_from_key is not None:
                    fill_from_key = previous.fill_from_key
            if unchanged and previous is not None and previous.op == UPSERT:
                for name in list(unchanged):
                    if name in previous.data:
                        data[name] = previous.data[name]
                        unchanged.discard(name)
                if fill_from_key is None:
                    # Still unchanged since the row moved: the values live where the move's did.
                    fill_from_key = previous.fill_from_key
            result.rows[key] = FoldedRow(
                UPSERT,
                data,
                frozenset(unchanged),
                relation,
                fill_from_key if unchanged else None,
                commit_lsn=change.commit_lsn,
                committed_at=change.ts,
            )
    return result
