"""The SQL catalog's commits (iceberg/sql_catalog.py): a commit of a table still current reads
nothing back, and one whose table another writer moved, before or during the commit, fails or lands
on top of that writer's commit, never over it."""

from __future__ import annotations

import os
from typing import Any

import pyarrow as pa
import pytest
from pyiceberg.catalog import Catalog
from pyiceberg.exceptions import CommitFailedException, TableAlreadyExistsError
from pyiceberg.schema import Schema
from pyiceberg.serializers import FromInputFile
from pyiceberg.table import Table
from pyiceberg.types import LongType, NestedField, StringType

from pg2iceberg_dagster.iceberg.catalog import refresh
from pg2iceberg_dagster.iceberg.sql_catalog import MirrorSqlCatalog
from pg2iceberg_dagster.iceberg.transaction import open_transaction

from .conftest import SourceDb

SCHEMA = Schema(NestedField(1, "id", LongType(), required=True), NestedField(2, "v", StringType()))


def _rows(*ids: int) -> pa.Table:
    return pa.Table.from_pylist(
        [{"id": i, "v": f"row {i}"} for i in ids],
        pa.schema([pa.field("id", pa.int64(), nullable=False), pa.field("v", pa.string())]),
    )


def _ids(table: Table) -> list[int]:
    return sorted(table.scan().to_arrow()["id"].to_pylist())


def _catalogs(source: SourceDb, name: str) -> tuple[Catalog, Catalog, tuple[str, str]]:
    """Two catalog objects on the pipeline's SQL catalog (two writers) and a new table's identifier."""
    source.execute("CREATE TABLE IF NOT EXISTS public.anchor (id int PRIMARY KEY)")
    config = source.config(["public.anchor"])
    first, second = source.pipeline(config).catalog, source.pipeline(config).catalog
    assert isinstance(first, MirrorSqlCatalog)
    identifier = (config.iceberg.namespace, name)
    first.create_namespace_if_not_exists(identifier[:1])
    first.create_table(identifier, SCHEMA)
    return first, second, identifier


def test_a_commit_or_refresh_of_a_current_table_reads_nothing_back(
    source: SourceDb, monkeypatch: pytest.MonkeyPatch
) -> None:
    catalog, theirs, identifier = _catalogs(source, "current")
    table = catalog.load_table(identifier)
    reads: list[str] = []
    parse = FromInputFile.table_metadata

    def counted(input_file: Any, *args: Any, **kwargs: Any) -> Any:
        reads.append(input_file.location)
        return parse(input_file, *args, **kwargs)

    looks: list[tuple[str, str]] = []
    look = MirrorSqlCatalog._metadata_location

    def counted_look(self: MirrorSqlCatalog, namespace: str, name: str) -> str | None:
        looks.append((namespace, name))
        return look(self, namespace, name)

    monkeypatch.setattr(FromInputFile, "table_metadata", staticmethod(counted))
    monkeypatch.setattr(MirrorSqlCatalog, "_metadata_location", counted_look)
    with open_transaction(table) as transaction:  # as a snapshot chunk commits
        transaction.append(_rows(1))
    assert looks == []  # swapped from the file it was read from, no look first
    refresh(table)  # as a merge does before it writes
    with open_transaction(table) as transaction:
        transaction.append(_rows(2, 3))
    assert reads == []
    assert len(looks) == 1  # the refresh's
    with open_transaction(theirs.load_table(identifier)) as transaction:
        transaction.append(_rows(4))
    reads.clear()
    assert _ids(refresh(table)) == [1, 2, 3, 4]  # moved by another writer: read again
    assert len(reads) == 1
    monkeypatch.undo()
    loaded = catalog.load_table(identifier)
    assert loaded.metadata_location == table.metadata_location
    assert _ids(loaded) == [1, 2, 3, 4]
    assert len(loaded.metadata.metadata_log) == 3  # the files before each append, as pyiceberg logs them


def _history(table: Table) -> list[str]:
    """The metadata files the table went through, oldest first (its log, then its own)."""
    return [entry.metadata_file for entry in table.metadata.metadata_log] + [table.metadata_location]


def test_a_commit_of_a_table_another_writer_moved_fails_or_lands_on_top(source: SourceDb) -> None:
    mine, theirs, identifier = _catalogs(source, "moved")
    stale = mine.load_table(identifier)
    other = theirs.load_table(identifier)
    with open_transaction(other) as transaction:
        transaction.append(_rows(1))
    # An append expects the main branch where it read it: refused, and pyiceberg's retry appends
    # again on their commit.
    with open_transaction(stale) as transaction:
        transaction.append(_rows(2))
    assert _ids(theirs.load_table(identifier)) == [1, 2]
    # Changes with no such expectation, each from a table the other moved, land on top of each other.
    with open_transaction(other) as transaction:
        transaction.set_properties({"owner": "theirs"})
    with open_transaction(stale) as transaction:
        transaction.set_properties({"reader": "mine"})
    current = mine.load_table(identifier)
    assert (current.properties["owner"], current.properties["reader"]) == ("theirs", "mine")
    assert _ids(current) == [1, 2]
    assert other.metadata_location in _history(current)


def _their_append_after_write(
    monkeypatch: pytest.MonkeyPatch, theirs: Catalog, identifier: tuple[str, str], nth: int
) -> list[str]:
    """Another writer appends right after this process's ``nth`` metadata file is written (before its
    swap); returns the metadata files written here, then the other writer's file."""
    write = MirrorSqlCatalog._write_metadata
    written: list[str] = []
    theirs_committing: list[bool] = []

    def their_commit_after(metadata: Any, io: Any, location: str) -> None:
        write(metadata, io, location)
        if theirs_committing:
            return
        written.append(location)
        if len(written) == nth:
            theirs_committing.append(True)
            other = theirs.load_table(identifier)
            with open_transaction(other) as transaction:
                transaction.append(_rows(1))
            written.append(other.metadata_location)
            theirs_committing.clear()

    monkeypatch.setattr(MirrorSqlCatalog, "_write_metadata", staticmethod(their_commit_after))
    return written


def test_a_writer_before_a_current_tables_swap_is_kept_under_it(
    source: SourceDb, monkeypatch: pytest.MonkeyPatch
) -> None:
    mine, theirs, identifier = _catalogs(source, "raced")
    table = mine.load_table(identifier)
    written = _their_append_after_write(monkeypatch, theirs, identifier, nth=1)
    with open_transaction(table) as transaction:
        transaction.set_properties({"owner": "mine"})
    missed, their_file, landed = written  # the swap from the file read missed: staged on theirs
    current = mine.load_table(identifier)
    assert current.metadata_location == landed == table.metadata_location
    assert current.properties["owner"] == "mine"
    assert _ids(current) == [1]
    assert their_file in _history(current)
    assert missed not in _history(current)
    assert not os.path.exists(missed.removeprefix("file://"))  # nothing names it: deleted again


def test_a_writer_between_a_commits_look_and_its_swap_fails_it(
    source: SourceDb, monkeypatch: pytest.MonkeyPatch
) -> None:
    mine, theirs, identifier = _catalogs(source, "look")
    table = mine.load_table(identifier)
    with open_transaction(theirs.load_table(identifier)) as transaction:
        transaction.set_properties({"first": "theirs"})  # the table is stale: the commit looks
    written = _their_append_after_write(monkeypatch, theirs, identifier, nth=2)
    with pytest.raises(CommitFailedException), open_transaction(table) as transaction:
        transaction.set_properties({"owner": "mine"})
    their_file = written[-1]
    assert len(written) == 3  # the missed swap's file, the one staged after the look, theirs
    current = mine.load_table(identifier)
    assert current.metadata_location == their_file
    assert "owner" not in current.properties
    assert _ids(current) == [1]
    # Retried on the table as it is now, the commit lands on theirs.
    table.refresh()
    with open_transaction(table) as transaction:
        transaction.append(_rows(2))
    assert _ids(mine.load_table(identifier)) == [1, 2]


def test_a_table_created_twice_keeps_the_first(source: SourceDb) -> None:
    mine, theirs, identifier = _catalogs(source, "twice")
    with open_transaction(mine.load_table(identifier)) as transaction:
        transaction.append(_rows(1))
    with pytest.raises(TableAlreadyExistsError):
        theirs.create_table_transaction(identifier, SCHEMA).commit_transaction()
    assert _ids(theirs.load_table(identifier)) == [1]
