"""pyiceberg's SQL catalog, committing without reading back the table it was handed.

A mirror commits to each of its tables every few seconds (merges, snapshot chunks), so what a
commit costs beyond writing its metadata is paid per table and per merge. pyiceberg 0.12's
``SqlCatalog.commit_table`` loads the table again first (its catalog row, then the whole metadata
file parsed: it grows with the snapshots retained), stages the new metadata with a deep copy of it
all, and runs each statement through SQLAlchemy's ORM. Here:

- **The table is read again only when another writer moved it.** The committing table names the
  metadata file it was loaded from; metadata files are written once, so while the catalog row still
  names that file the table's own metadata *is* the current one. The commit is staged on it and
  swapped in by a compare-and-set of the row from that file, with no look first. When the row names
  another file (the swap missed; the file just written is deleted again), the commit goes as
  pyiceberg's: the current table loaded, the requirements checked on it, staged and swapped from
  its file, and a writer in between that look and the swap fails the commit
  (``CommitFailedException``, retried by the caller).
- **No deep copy** of the metadata (see :func:`.transaction.staged_metadata`).
- **Prepared Core statements** instead of an ORM session per statement.
- **A new table's commit inserts its row without looking first**: the row's primary key refuses a
  second one (``TableAlreadyExistsError``, as pyiceberg's).

``open_catalog`` uses it for every SQL catalog; the tables, rows and files are pyiceberg's own.
"""

from __future__ import annotations

import contextlib
from functools import cache
from typing import Any

from pyiceberg.catalog import Catalog
from pyiceberg.catalog.sql import IcebergTables, SqlCatalog
from pyiceberg.exceptions import CommitFailedException, NoSuchTableError, TableAlreadyExistsError
from pyiceberg.table import CommitTableResponse, StagedTable, Table
from pyiceberg.table.locations import load_location_provider
from pyiceberg.table.metadata import TableMetadata
from pyiceberg.table.update import AssertCreate, TableRequirement, TableUpdate
from pyiceberg.typedef import Identifier
from sqlalchemy import Select, Update, bindparam, insert, select, update
from sqlalchemy.exc import IntegrityError

from .transaction import staged_metadata


class MirrorSqlCatalog(SqlCatalog):
    """``SqlCatalog`` whose loads cost a row lookup and whose commits a compare-and-set of the row, not a
    read of the table (see module)."""

    def __init__(self, name: str, **properties: str) -> None:
        super().__init__(name, **properties)
        rows = IcebergTables.__table__.c
        table_row = (
            rows.catalog_name == bindparam("row_catalog"),
            rows.table_namespace == bindparam("row_namespace"),
            rows.table_name == bindparam("row_name"),
        )
        location = select(rows.metadata_location).where(*table_row)
        if (type_filter := self._iceberg_type_filter()) is not None:  # known once the catalog's schema is read
            location = location.where(type_filter)
        self._location_query: Select[tuple[str | None]] = location
        # The compare-and-set of a table's row from the metadata file a commit read to its new one.
        self._swap: Update = (
            update(IcebergTables)
            .where(*table_row, rows.metadata_location == bindparam("expected"))
            .values(metadata_location=bindparam("new_location"), previous_metadata_location=bindparam("expected"))
        )

    def load_table(self, identifier: str | Identifier) -> Table:
        """The table as its catalog row names it (``NoSuchTableError`` when there is none)."""
        namespace, name = self._row_key(identifier)
        location = self._metadata_location(namespace, name)
        if location is None:
            raise NoSuchTableError(f"Table does not exist: {namespace}.{name}")
        return self._table_at(namespace, name, location)

    def commit_table(
        self, table: Table, requirements: tuple[TableRequirement, ...], updates: tuple[TableUpdate, ...]
    ) -> CommitTableResponse:
        """Commit ``updates`` to ``table`` if ``requirements`` hold on the catalog's current table."""
        namespace, name = self._row_key(table.name())
        if any(isinstance(requirement, AssertCreate) for requirement in requirements):
            return self._create(table.name(), namespace, name, requirements, updates)
        # Swapped from the file the table was read from, as it is when no other writer moved it.
        committed = self._stage_and_swap(table, namespace, name, requirements, updates)
        if committed is not None:
            return committed
        location = self._metadata_location(namespace, name)
        if location is None:  # dropped meanwhile: as pyiceberg, the table's identity fails
            raise CommitFailedException(f"Table {namespace}.{name} no longer exists")
        committed = self._stage_and_swap(
            self._table_at(namespace, name, location), namespace, name, requirements, updates
        )
        if committed is None:
            raise CommitFailedException(f"Table has been updated by another process: {namespace}.{name}")
        return committed

    def _create(
        self,
        identifier: Identifier,
        namespace: str,
        name: str,
        requirements: tuple[TableRequirement, ...],
        updates: tuple[TableUpdate, ...],
    ) -> CommitTableResponse:
        staged = self._update_and_stage_table(None, identifier, requirements, updates)
        self._write_metadata(staged.metadata, staged.io, staged.metadata_location)
        try:
            with self.engine.begin() as connection:
                connection.execute(
                    insert(IcebergTables), [self._create_table_row(namespace, name, staged.metadata_location)]
                )
        except IntegrityError as exc:
            raise TableAlreadyExistsError(f"Table {namespace}.{name} already exists") from exc
        return CommitTableResponse(metadata=staged.metadata, metadata_location=staged.metadata_location)

    def _stage_and_swap(
        self,
        base: Table,
        namespace: str,
        name: str,
        requirements: tuple[TableRequirement, ...],
        updates: tuple[TableUpdate, ...],
    ) -> CommitTableResponse | None:
        """``updates`` staged on ``base``, its metadata written, and the row swapped from ``base``'s
        file to it; None (the file deleted again) when the row named another file."""
        staged = self._update_and_stage_table(base, base.name(), requirements, updates)
        if staged.metadata == base.metadata:
            return CommitTableResponse(metadata=base.metadata, metadata_location=base.metadata_location)
        self._write_metadata(staged.metadata, staged.io, staged.metadata_location)
        with self.engine.begin() as connection:
            swapped = connection.execute(
                self._swap,
                {
                    **self._row(namespace, name),
                    "expected": base.metadata_location,
                    "new_location": staged.metadata_location,
                },
            )
        if swapped.rowcount < 1:
            # Nothing names it: a file left behind is only space (orphan-file maintenance removes it),
            # and whatever the file IO raises (each store its own errors) must not hide the miss.
            with contextlib.suppress(Exception):
                staged.io.delete(staged.metadata_location)
            return None
        return CommitTableResponse(metadata=staged.metadata, metadata_location=staged.metadata_location)

    def names_current(self, table: Table) -> bool:
        """Whether the table's catalog row still names the metadata file ``table`` was read from."""
        return self._metadata_location(*self._row_key(table.name())) == table.metadata_location

    def _update_and_stage_table(
        self,
        current_table: Table | None,
        table_identifier: Identifier,
        requirements: tuple[TableRequirement, ...],
        updates: tuple[TableUpdate, ...],
    ) -> StagedTable:
        if current_table is None:  # a new table: pyiceberg's own staging, which validates it whole
            return super()._update_and_stage_table(None, table_identifier, requirements, updates)
        for requirement in requirements:
            requirement.validate(current_table.metadata)
        metadata = staged_metadata(current_table.metadata, updates, current_table.metadata_location)
        version = self._parse_metadata_version(current_table.metadata_location) + 1
        location = load_location_provider(metadata.location, metadata.properties).new_table_metadata_file_location(
            version
        )
        return StagedTable(
            identifier=table_identifier,
            metadata=metadata,
            metadata_location=location,
            io=self._load_file_io(properties=metadata.properties, location=location),
            catalog=self,
        )

    @staticmethod
    @cache
    def _empty_table_metadata() -> TableMetadata:
        # The base a new table's creation is staged on (immutable, and rebuilt whole by the staging):
        # building it asks pydantic for each default's signature, a fifth of a table's creation.
        return SqlCatalog._empty_table_metadata()

    @staticmethod
    def _row_key(identifier: str | Identifier) -> tuple[str, str]:
        return Catalog.namespace_to_string(Catalog.namespace_from(identifier)), Catalog.table_name_from(identifier)

    def _row(self, namespace: str, name: str) -> dict[str, str]:
        """The parameters naming a table's catalog row in the row lookup and the swap."""
        return {"row_catalog": self.name, "row_namespace": namespace, "row_name": name}

    def _metadata_location(self, namespace: str, name: str) -> str | None:
        """The metadata file the table's catalog row names; None without a row."""
        with self.engine.connect() as connection:
            found: Any = connection.execute(self._location_query, self._row(namespace, name)).first()
        if found is None or not found[0]:
            return None
        return str(found[0])

    def _table_at(self, namespace: str, name: str, location: str) -> Table:
        row = IcebergTables(
            catalog_name=self.name,
            table_namespace=namespace,
            table_name=name,
            metadata_location=location,
            previous_metadata_location=None,
        )
        return self._convert_orm_to_iceberg(row)
