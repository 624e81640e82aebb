"""Iceberg manifests and manifest lists read once per process, not at every look at them.

A merge written by pyiceberg reads its table's manifest list and the manifests in it three times:
planning the scan for the batch's keys, then twice in its overwrite (the manifests it carries over,
the entries it deletes). Each read opens the Avro file again and converts its header's schema to
pyiceberg's models; pyiceberg keeps the manifest objects of the last 128 manifests but reads their
entries, and the list, again every time. At 200 tables that was a quarter of a merge's CPU in `run`
(bench/tables.py under py-spy: 12% of the process's samples, merges 46%).

Both files are written once under a name nobody writes again (a new snapshot writes new ones) and are
never changed, so what a path held when read holds for the life of the process. A manifest's entries
also inherit their sequence numbers, snapshot id and spec id from the list's record of the manifest,
so they are kept per path and those values (an uncommitted manifest has no sequence number yet).

Kept: the most recently used, up to ``ENTRY_BUDGET`` entries and ``LIST_BUDGET`` manifests in lists;
a manifest larger than the budget is read every time, as before. The entries are shared between
readers; pyiceberg never changes an entry it read (it writes copies with a new status).

Each file read for the first time still had its header's schema converted and a reader built for it,
the same few schemas every time (one per kind of file and partition type): a tenth of `run`'s time
holding the interpreter after the above (py-spy ``--gil``). Both are kept by the schema's text; a
reader holds no state between records.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from enum import Enum
from typing import Generic, TypeVar

import pyiceberg.avro.file as pyiceberg_avro_file
from pyiceberg.avro.file import AvroFileHeader
from pyiceberg.avro.reader import Reader
from pyiceberg.io import FileIO
from pyiceberg.manifest import ManifestEntry, ManifestEntryStatus, ManifestFile
from pyiceberg.schema import Schema
from pyiceberg.table.snapshots import Snapshot
from pyiceberg.typedef import EMPTY_DICT, StructProtocol
from pyiceberg.types import IcebergType

# About 1 to 3 KiB each in Python (a data file's path, counts and column bounds): tens of MiB at most.
ENTRY_BUDGET = 20_000
# Manifest records held by cached lists; the records are small and mostly shared with pyiceberg's own.
LIST_BUDGET = 20_000
# Distinct Avro schemas, and readers for them: a handful per table layout.
SCHEMA_BUDGET = 256

_Key = TypeVar("_Key", bound=Hashable)
_Value = TypeVar("_Value")


class _WeightedLru(Generic[_Key, _Value]):
    """Values by key, least recently used dropped first once their total weight passes ``budget``."""

    def __init__(self, budget: int, weight: Callable[[_Value], int]) -> None:
        self._budget = budget
        self._weigh = weight
        self._held: OrderedDict[_Key, _Value] = OrderedDict()
        self._weight = 0
        self._lock = threading.Lock()

    def get_or_read(self, key: _Key, read: Callable[[], _Value]) -> _Value:
        with self._lock:
            held = self._held.get(key)
            if held is not None:
                self._held.move_to_end(key)
                return held
        # Read outside the lock: two threads may read one file at once, and both get the same content.
        value = read()
        weight = self._weigh(value)
        if weight > self._budget:
            return value
        with self._lock:
            if key not in self._held:
                self._held[key] = value
                self._weight += weight
            while self._weight > self._budget:
                _, dropped = self._held.popitem(last=False)
                self._weight -= self._weigh(dropped)
        return value


# One more than their length: an empty manifest or list still counts, so the budget bounds their number too.
_entries: _WeightedLru[tuple[str, int, int | None, int], tuple[ManifestEntry, ...]] = _WeightedLru(
    ENTRY_BUDGET, lambda entries: 1 + len(entries)
)
_lists: _WeightedLru[str, tuple[ManifestFile, ...]] = _WeightedLru(LIST_BUDGET, lambda manifests: 1 + len(manifests))
_schemas: _WeightedLru[str, Schema] = _WeightedLru(SCHEMA_BUDGET, lambda _: 1)
# By the identities of the schemas, which the value holds: an id is not reused while its entry is kept.
_ReaderKey = tuple[int, int, tuple[tuple[int, object], ...], tuple[tuple[int, object], ...]]
_readers: _WeightedLru[_ReaderKey, tuple[object, object, Reader]] = _WeightedLru(SCHEMA_BUDGET, lambda _: 1)
_pyiceberg_fetch_entries = ManifestFile.fetch_manifest_entry
_pyiceberg_manifests = Snapshot.manifests
_pyiceberg_header_schema = AvroFileHeader.get_schema
_pyiceberg_resolve_reader = pyiceberg_avro_file.resolve_reader
_AVRO_SCHEMA_KEY = "avro.schema"  # the Avro container format's header key for the writer's schema


def _fetch_entries_once(self: ManifestFile, io: FileIO, discard_deleted: bool = True) -> list[ManifestEntry]:
    key = (self.manifest_path, self.sequence_number, self.added_snapshot_id, self.partition_spec_id)
    entries = _entries.get_or_read(key, lambda: tuple(_pyiceberg_fetch_entries(self, io, discard_deleted=False)))
    if discard_deleted:
        return [entry for entry in entries if entry.status != ManifestEntryStatus.DELETED]
    return list(entries)


def _manifests_once(self: Snapshot, io: FileIO) -> list[ManifestFile]:
    return list(_lists.get_or_read(self.manifest_list, lambda: tuple(_pyiceberg_manifests(self, io))))


def _header_schema_once(self: AvroFileHeader) -> Schema:
    text = self.meta.get(_AVRO_SCHEMA_KEY)
    if text is None:
        return _pyiceberg_header_schema(self)  # pyiceberg's error for a header without one
    return _schemas.get_or_read(text, lambda: _pyiceberg_header_schema(self))


def _resolve_reader_once(
    file_schema: Schema | IcebergType,
    read_schema: Schema | IcebergType,
    read_types: dict[int, Callable[..., StructProtocol]] = EMPTY_DICT,
    read_enums: dict[int, Callable[..., Enum]] = EMPTY_DICT,
) -> Reader:
    key = (id(file_schema), id(read_schema), tuple(read_types.items()), tuple(read_enums.items()))
    resolved = _readers.get_or_read(
        key,
        lambda: (file_schema, read_schema, _pyiceberg_resolve_reader(file_schema, read_schema, read_types, read_enums)),
    )
    return resolved[2]


def read_manifests_once() -> None:
    """Make pyiceberg read each manifest and manifest list once in this process (see the module's
    docstring); idempotent."""
    ManifestFile.fetch_manifest_entry = _fetch_entries_once  # type: ignore[method-assign]
    Snapshot.manifests = _manifests_once  # type: ignore[method-assign]
    AvroFileHeader.get_schema = _header_schema_once  # type: ignore[method-assign]
    pyiceberg_avro_file.resolve_reader = _resolve_reader_once
