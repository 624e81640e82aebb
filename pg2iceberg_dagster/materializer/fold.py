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

from ..staging.codec import DELETE, TRUNCATE, Change, StagedRelation

UPSERT = "U"


@dataclass
class FoldedRow:
    """The net effect on one key: an upsert of ``data`` (minus ``unchanged`` columns) or a delete."""

    op: str
    data: dict[str, str | None]
    unchanged: frozenset[str] = frozenset()
    relation: StagedRelation | None = None


@dataclass
class FoldResult:
    truncated: bool = False
    rows: dict[tuple[str | None, ...], FoldedRow] = field(default_factory=dict)
    changes: int = 0
    relations: list[StagedRelation] = field(default_factory=list)


def fold(batches: Iterable[tuple[StagedRelation, Sequence[Change]]], primary_key: Sequence[str]) -> FoldResult:
    """Fold staged files (in log order) into the net change per primary key."""
    result = FoldResult()
    for relation, changes in batches:
        if relation not in result.relations:
            result.relations.append(relation)
        column_names = {column.name for column in relation.columns}
        for change in changes:
            result.changes += 1
            if change.op == TRUNCATE:
                result.rows.clear()
                result.truncated = True
                continue
            key = tuple(change.data[name] for name in primary_key)
            if change.op == DELETE:
                result.rows[key] = FoldedRow(DELETE, dict(change.data))
                continue
            data = dict(change.data)
            # Columns of the Iceberg table that this change does not carry keep their current value.
            unchanged = set(change.unchanged)
            previous = result.rows.get(key)
            if unchanged and previous is not None and previous.op == UPSERT:
                for name in list(unchanged):
                    if name in previous.data:
                        data[name] = previous.data[name]
                        unchanged.discard(name)
                unchanged |= previous.unchanged & column_names
            result.rows[key] = FoldedRow(UPSERT, data, frozenset(unchanged), relation)
    return result
