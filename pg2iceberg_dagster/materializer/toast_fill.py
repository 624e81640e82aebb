"""Unchanged TOAST values of a row whose primary key changed: the new key's row takes them from the
old key's row in Iceberg (pgoutput sends only the changed values)."""

from __future__ import annotations

from typing import Any

from pyiceberg.table import Table

from ..iceberg.types import arrow_schema
from .fold import FoldResult


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
