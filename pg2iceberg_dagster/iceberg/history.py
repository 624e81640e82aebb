"""History tables (docs/history.md): one row per version of each source row, beside the mirror.

A history table holds the mirror's source columns (all optional: it has no key, a key has many rows)
and six columns of its own: valid from (commit LSN and time), valid to (NULL while current), the
operation that wrote the version and a current flag. Which columns these are is recorded in a table
property, and what the table holds of the staged log in the summary of each commit that writes it
(:data:`HISTORY_EPOCH`, :data:`HISTORY_OFFSET`), so a merge retried after a crash neither loses nor
repeats a version.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass

from pyiceberg.catalog import Catalog
from pyiceberg.exceptions import NamespaceAlreadyExistsError, NoSuchTableError, ResolveError
from pyiceberg.expressions import And, BooleanExpression, GreaterThan, IsNull, LessThanOrEqual, Or
from pyiceberg.schema import Schema, promote
from pyiceberg.table import Table
from pyiceberg.types import BooleanType, IcebergType, LongType, NestedField, StringType, TimestamptzType
from sqlalchemy.exc import IntegrityError

from ..config import ChangeMetadataConfig
from ..errors import ConfigError, StartupCheckError
from .change_metadata import metadata_names
from .commit import commit_with_retry
from .transaction import open_transaction

HISTORY_COLUMNS = "pg2iceberg.history-columns"
# Which field of the live table each source column of the history table mirrors (name -> field id), so a
# column renamed at the source (and so in the live table) is renamed in the history table too.
LIVE_FIELDS = "pg2iceberg.history-live-fields"
# In the summary of each commit writing a history table: the snapshot epoch its first versions came
# from, and the staged log offset up to which it holds every version.
HISTORY_EPOCH = "pg2iceberg.history-epoch"
HISTORY_OFFSET = "pg2iceberg.history-offset"

INSERT, UPDATE, SNAPSHOT = "insert", "update", "snapshot"


@dataclass(frozen=True)
class HistoryColumns:
    """The names of a history table's own columns."""

    valid_from_lsn: str
    valid_from_at: str
    valid_to_lsn: str
    valid_to_at: str
    operation: str
    current: str

    @property
    def names(self) -> tuple[str, ...]:
        return (
            self.valid_from_lsn,
            self.valid_from_at,
            self.valid_to_lsn,
            self.valid_to_at,
            self.operation,
            self.current,
        )

    def fields(self) -> list[tuple[str, IcebergType]]:
        """Each column's name and Iceberg type."""
        types: list[IcebergType] = [LongType(), TimestamptzType(), LongType(), TimestamptzType(), StringType()]
        return [*zip(self.names, [*types, BooleanType()], strict=True)]

    @classmethod
    def of(cls, config: ChangeMetadataConfig) -> HistoryColumns:
        return cls(*config.history_column_names())

    @classmethod
    def recorded(cls, table: Table) -> HistoryColumns:
        """The columns ``table`` (a history table) records."""
        return cls(**json.loads(table.properties[HISTORY_COLUMNS]))


@dataclass(frozen=True)
class HistoryPosition:
    """What a history table holds: versions from snapshot epoch ``epoch`` on, up to staged offset ``offset``."""

    epoch: int | None
    offset: int


def history_position(table: Table) -> HistoryPosition:
    """The position the last commit writing ``table`` recorded (epoch None: no version written yet)."""
    snapshots = table.snapshots()
    for snapshot in reversed(snapshots):
        summary = snapshot.summary.additional_properties if snapshot.summary else {}
        if HISTORY_EPOCH in summary:
            return HistoryPosition(int(summary[HISTORY_EPOCH]), int(summary.get(HISTORY_OFFSET, "0")))
    return HistoryPosition(None, 0)


def snapshots_to_keep(table: Table) -> int:
    """How many of the history table's newest snapshots reach back to the last one recording its
    position (see :func:`history_position`): snapshot expiry keeps at least these, or the position
    would be lost and the versions written again."""
    snapshots = table.snapshots()
    for back, snapshot in enumerate(reversed(snapshots), start=1):
        if HISTORY_EPOCH in (snapshot.summary.additional_properties if snapshot.summary else {}):
            return back
    return len(snapshots)


def source_fields(live: Table) -> list[NestedField]:
    """The live table's source columns, optional (a history table has no key: a key has many rows)."""
    leave_out = metadata_names(live)
    return [
        NestedField(field.field_id, field.name, field.field_type, required=False, doc=field.doc)
        for field in live.schema().fields
        if field.name not in leave_out
    ]


def ensure_history_table(
    catalog: Catalog,
    identifier: tuple[str, str],
    live: Table,
    settings: ChangeMetadataConfig,
    table_key: str,
    location: str | None,
    properties: Mapping[str, str],
) -> Table:
    """The history table of ``live`` at ``identifier``: created when missing (at ``location``, None
    for the catalog's default, with the table ``properties``), its columns following the live
    table's (see :func:`follow_live_columns`)."""
    columns = HistoryColumns.of(settings)
    clash = sorted({field.name for field in source_fields(live)} & set(columns.names))
    if clash:
        raise StartupCheckError(
            f"table {table_key}: source column {clash[0]} has the name of a column of its history table; rename the "
            f"source column (ALTER TABLE {table_key} RENAME COLUMN ...), or give the history columns other names "
            "(change_metadata.valid_from_lsn_column, ...) before its history is first written; then run again"
        )
    try:
        table = catalog.load_table(identifier)
    except NoSuchTableError:
        with contextlib.suppress(NamespaceAlreadyExistsError, IntegrityError):
            catalog.create_namespace(identifier[:1])
        fields = source_fields(live)
        fields += [
            NestedField(len(fields) + index + 1, name, field_type, required=False)
            for index, (name, field_type) in enumerate(columns.fields())
        ]
        schema = Schema(*[NestedField(i + 1, f.name, f.field_type, False, f.doc) for i, f in enumerate(fields)])
        live_fields = json.dumps({field.name: field.field_id for field in source_fields(live)}, sort_keys=True)
        own = {HISTORY_COLUMNS: json.dumps(columns.__dict__), LIVE_FIELDS: live_fields}
        return catalog.create_table_if_not_exists(
            identifier, schema, location=location, properties={**properties, **own}
        )
    recorded = HistoryColumns.recorded(table)
    if recorded != columns:
        raise ConfigError(
            f"table {table_key}: its history table has the columns {', '.join(recorded.names)}, and the "
            f"configuration names {', '.join(columns.names)}; set the names back (renaming them is not supported)"
        )
    return follow_live_columns(table, live)


def follow_live_columns(table: Table, live: Table) -> Table:
    """``table`` (a history table) with the source columns of ``live``: one the live table renamed is
    renamed here too (the live table's field it mirrors is recorded in :data:`LIVE_FIELDS`), one it
    added is added, a widened type widened. A column the live table lost stays (earlier versions'
    values), and so does one whose type the live table changed beyond widening (a resync rebuilt it):
    renamed aside to ``<name>__was_<type>``, the new column taking the name."""
    recorded: dict[str, int] = json.loads(table.properties.get(LIVE_FIELDS, "{}"))
    names_by_id = {field_id: name for name, field_id in recorded.items()}
    present = {field.name: field.field_type for field in table.schema().fields}
    wanted = source_fields(live)
    renames = {
        names_by_id[field.field_id]: field.name
        for field in wanted
        if names_by_id.get(field.field_id, field.name) != field.name and field.name not in present
    }
    renames |= {
        field.name: _aside(field.name, present[field.name], present)
        for field in wanted
        if field.name in present and not _widens(present[field.name], field.field_type)
    }
    mapping = {renames.get(name, name): field_id for name, field_id in recorded.items()}
    mapping |= {field.name: field.field_id for field in wanted}
    if not renames and mapping == recorded and all(present.get(f.name) == f.field_type for f in wanted):
        return table

    def follow() -> None:
        table.refresh()
        with open_transaction(table) as transaction:
            if renames:
                with transaction.update_schema() as update:
                    for old, new in renames.items():
                        update.rename_column(old, new)
            with transaction.update_schema() as update:
                update.union_by_name(Schema(*wanted))
            transaction.set_properties({LIVE_FIELDS: json.dumps(mapping, sort_keys=True)})

    commit_with_retry(follow)
    table.refresh()
    return table


def _widens(was: IcebergType, now: IcebergType) -> bool:
    """Whether a column of type ``was`` can hold ``now`` (the same type, or a promotion Iceberg allows)."""
    try:
        return was == now or promote(was, now) == now
    except ResolveError:
        return False


def _aside(name: str, was: IcebergType, present: dict[str, IcebergType]) -> str:
    """A free name for the column ``name`` of type ``was`` moved aside: ``<name>__was_<type>``."""
    base = f"{name}__was_{re.sub(r'[^A-Za-z0-9]+', '_', str(was)).strip('_')}"
    candidate, number = base, 1
    while candidate in present:
        number += 1
        candidate = f"{base}_{number}"
    return candidate


def as_of(table: Table, lsn: int) -> BooleanExpression:
    """The rows of ``table`` (a history table) that make up the source table as of commit LSN ``lsn``:
    valid from at or before it, and valid to after it (or still current)."""
    own = HistoryColumns.recorded(table)
    return And(
        LessThanOrEqual(term=own.valid_from_lsn, value=lsn),
        Or(IsNull(term=own.valid_to_lsn), GreaterThan(term=own.valid_to_lsn, value=lsn)),
    )
