"""Folding a batch of staged changes to at most one change per primary key (last change wins).

Changes arrive in log order (the order the flusher registered them, i.e. commit order, and the
order inside each transaction). Folding keeps, per key, the last change; an update whose TOASTed
columns were unchanged takes them from an earlier change in the batch when there is one, and
otherwise leaves them to be filled from the current Iceberg row during the MERGE. A TRUNCATE
discards everything folded before it and makes the merge start by emptying the table.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from ..staging.codec import DELETE, TRUNCATE, Change, StagedRelation

UPSERT = "U"
Key = tuple[str | None, ...]


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
    rows: dict[Key, FoldedRow] = field(default_factory=dict)
    changes: int = 0
    relations: list[StagedRelation] = field(default_factory=list)


def fold(batches: Iterable[tuple[StagedRelation, Sequence[Change]]], primary_key: Sequence[str]) -> FoldResult:
    """Fold staged files (in log order) into the net change per primary key."""
    result = FoldResult()
    last_delete: tuple[int, Key, FoldedRow | None] | None = None
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
            if last_delete is not None and is_key_change(last_delete[:2], change, key):
                # The unchanged columns belong to the old key's row.
                old_key, previous = last_delete[1], last_delete[2]
                fill_from_key = old_key
                if previous is not None and previous.op == UPSERT and previous.fill_from_key is not None:
                    fill_from_key = previous.fill_from_key
            if unchanged and previous is not None and previous.op == UPSERT:
                carry_unchanged(data, unchanged, previous.data)
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


def is_key_change(last_delete: tuple[int, Key], change: Change, key: Key) -> bool:
    """Whether ``change`` (to ``key``) is the second half of a key-changing UPDATE, given the batch's
    last DELETE (its LSN and key): the flusher stages one as DELETE(old key) + UPDATE(new key) at one LSN."""
    return last_delete[0] == change.lsn and last_delete[1] != key


def carry_unchanged(data: dict[str, str | None], unchanged: set[str], earlier: Mapping[str, str | None]) -> None:
    """Give the columns a change leaves unchanged (TOAST values) the values an earlier change of the
    row carried, in place: ``data`` gains them and ``unchanged`` loses them."""
    for name in list(unchanged):
        if name in earlier:
            data[name] = earlier[name]
            unchanged.discard(name)
