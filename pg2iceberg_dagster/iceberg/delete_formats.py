"""How a mirror table records deleted rows, chosen for the engines that read it (docs/readers.md).

Three formats exist for an Iceberg table a merge changes:

- ``copy-on-write``: a merge rewrites every data file a changed key lives in; no delete files, so
  every engine reads it;
- ``merge-on-read``: Iceberg format-version 2 position delete files (Spark's ``MERGE`` and the branch
  path's ``DELETE``), cheaper merges, read by most engines;
- ``deletion-vectors``: format-version 3 deletion vectors (one Puffin bitmap per data file). The Spark
  runtime this project ships (Iceberg 1.10.2) writes them, but pyiceberg 0.12, which writes the
  snapshot, resyncs, repairs and every schema or property change, cannot write a v3 table's metadata
  (``NotImplementedError``, apache/iceberg-python#1551): the format is refused until it can.

Which engine reads which format is measured here for pyiceberg, Spark, DuckDB and Daft
(tests/test_independent_readers.py) and taken from the vendors' documentation for the others.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:  # the config imports this module: a process that only reads its config skips pyiceberg
    from pyiceberg.table import Table

DeleteFormat = Literal["copy-on-write", "merge-on-read", "deletion-vectors"]
COPY_ON_WRITE: DeleteFormat = "copy-on-write"
MERGE_ON_READ: DeleteFormat = "merge-on-read"
DELETION_VECTORS: DeleteFormat = "deletion-vectors"

# What each format means in the words of a reader's documentation (for errors).
DESCRIBED: dict[str, str] = {
    COPY_ON_WRITE: "copy-on-write (no delete files)",
    MERGE_ON_READ: "merge-on-read (Iceberg v2 position delete files)",
    DELETION_VECTORS: "deletion-vectors (Iceberg v3 deletion vectors)",
}

_ALL = frozenset({COPY_ON_WRITE, MERGE_ON_READ, DELETION_VECTORS})
_NO_DELETION_VECTORS = frozenset({COPY_ON_WRITE, MERGE_ON_READ})
# The formats each engine reads. Measured here: pyiceberg 0.12, Spark 3.5 + Iceberg 1.10.2, DuckDB 1.5.5
# read all three; Daft 0.6.14 opens a deletion vector's Puffin file as Parquet and fails. Documented:
# Trino's and Athena's Iceberg readers take v2 position (and equality) deletes but no deletion vectors;
# Snowflake reads position deletes (GA 2025-10) and v3 deletion vectors (v3 GA 2026-05), never
# equality deletes (which this project does not write); Databricks reads Iceberg v3 deletion vectors
# but not v2 position delete files.
READS: dict[str, frozenset[str]] = {
    "spark": _ALL,
    "pyiceberg": _ALL,
    "duckdb": _ALL,
    "daft": _NO_DELETION_VECTORS,
    "trino": _NO_DELETION_VECTORS,
    "athena": _NO_DELETION_VECTORS,
    "snowflake": _ALL,
    "databricks": frozenset({COPY_ON_WRITE, DELETION_VECTORS}),
}
READERS = tuple(READS)

# Cheapest merges first; copy-on-write, which every reader reads, last.
_PREFERENCE: tuple[DeleteFormat, ...] = (DELETION_VECTORS, MERGE_ON_READ, COPY_ON_WRITE)
# Formats this project can write today (see the module docstring for deletion vectors).
WRITABLE = frozenset({COPY_ON_WRITE, MERGE_ON_READ})
WHY_NOT_WRITABLE = {
    DELETION_VECTORS: (
        "deletion-vectors needs an Iceberg format-version 3 table, and pyiceberg 0.12.0 (which writes the "
        "snapshot, resyncs, repairs and schema changes of every mirror table) cannot write v3 metadata "
        "(NotImplementedError: apache/iceberg-python#1551), though Spark's Iceberg 1.10.2 runtime writes "
        "deletion vectors"
    )
}
_MODES = tuple(f"write.{operation}.mode" for operation in ("merge", "update", "delete"))
FORMAT_VERSION = "format-version"


def chosen_format(readers: Iterable[str]) -> DeleteFormat:
    """The format with the cheapest merges that this project writes and every one of ``readers`` reads."""
    wanted = list(readers)
    for candidate in _PREFERENCE:
        if candidate in WRITABLE and all(candidate in READS[reader] for reader in wanted):
            return candidate
    return COPY_ON_WRITE


def unable_to_read(delete_format: str, readers: Iterable[str]) -> list[str]:
    """Those of ``readers`` that cannot read a table in ``delete_format``."""
    return [reader for reader in readers if delete_format not in READS[reader]]


def format_properties(delete_format: str) -> dict[str, str]:
    """The table properties that make Spark's merges, updates and deletes write ``delete_format``."""
    mode = "copy-on-write" if delete_format == COPY_ON_WRITE else "merge-on-read"
    return {FORMAT_VERSION: "3" if delete_format == DELETION_VECTORS else "2", **{key: mode for key in _MODES}}


def format_of(properties: Mapping[str, str]) -> DeleteFormat:
    """The format a table with ``properties`` is written in (Iceberg's default: copy-on-write)."""
    if properties.get("write.merge.mode") != "merge-on-read":
        return COPY_ON_WRITE
    return DELETION_VECTORS if properties.get(FORMAT_VERSION, "2") == "3" else MERGE_ON_READ


def conflicting_modes(properties: Mapping[str, str], delete_format: str) -> dict[str, str]:
    """The ``write.*.mode`` entries of ``properties`` that say otherwise than ``delete_format``."""
    wanted = format_properties(delete_format)
    return {key: properties[key] for key in _MODES if key in properties and properties[key] != wanted[key]}


def align_table(table: Table, delete_format: str) -> dict[str, str]:
    """Set the write modes of an existing table to ``delete_format`` (one commit, none when they
    already are); returns the properties changed. Files written before keep their format: delete files
    stay until maintenance compacts them."""
    wanted = {key: value for key, value in format_properties(delete_format).items() if key in _MODES}
    changed = {key: value for key, value in wanted.items() if table.properties.get(key) != value}
    if changed:
        table.transaction().set_properties(changed).commit_transaction()
    return changed


def merges_on_read(table: Table) -> bool:
    """Whether the table's deletes are merge-on-read (position deletes): pyiceberg's delete would
    rewrite the data files instead."""
    properties = table.properties
    return "merge-on-read" in (properties.get("write.delete.mode"), properties.get("write.merge.mode"))
