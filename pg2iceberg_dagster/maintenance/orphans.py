"""Files under an Iceberg table's location that none of its snapshots or metadata reference.

Written here rather than through Spark's ``remove_orphan_files``: that procedure refuses an age under
24 hours, and works only where the JVM reaches the files. This reads the table's metadata with
pyiceberg and lists the location with the table's own FileIO (file:// and s3:// alike).
"""

from __future__ import annotations

import time

from pyarrow import fs
from pyiceberg.io.pyarrow import PyArrowFileIO
from pyiceberg.manifest import ManifestFile
from pyiceberg.table import Table


def _path(location: str) -> str:
    """A location as the filesystem lists it: ``file:/x``, ``file:///x`` and ``/x`` are one file
    (Spark and pyiceberg spell local paths differently); ``s3://b/k`` is ``b/k``."""
    return PyArrowFileIO.parse_location(location)[2]


def referenced_files(table: Table) -> set[str]:
    """Every file the table's metadata reaches: metadata files (current and logged), statistics, and
    of every snapshot its manifest list, manifests and their data and delete files (removed entries
    too: an older snapshot may still read them)."""
    metadata = table.metadata
    locations = {table.metadata_location, *(entry.metadata_file for entry in metadata.metadata_log)}
    locations.update(statistics.statistics_path for statistics in metadata.statistics)
    locations.update(statistics.statistics_path for statistics in metadata.partition_statistics)
    manifests: dict[str, ManifestFile] = {}
    for snapshot in metadata.snapshots:
        locations.add(snapshot.manifest_list)
        for manifest in snapshot.manifests(table.io):
            manifests.setdefault(manifest.manifest_path, manifest)
    for path, manifest in manifests.items():
        locations.add(path)
        for entry in manifest.fetch_manifest_entry(table.io, discard_deleted=False):
            locations.add(entry.data_file.file_path)
    return {_path(location) for location in locations}


def orphan_files(table: Table, min_age_seconds: float) -> list[str]:
    """Files under the table's location that nothing references and that are older than
    ``min_age_seconds`` (a younger one may belong to a commit in flight), as full locations."""
    scheme, netloc, root = PyArrowFileIO.parse_location(table.location())
    io = table.io
    if not isinstance(io, PyArrowFileIO):
        raise TypeError(f"orphan removal needs pyiceberg's PyArrowFileIO, not {type(io).__name__}")
    filesystem = io.fs_by_scheme(scheme, netloc)
    # Read the references after listing: a file committed in between is then both listed and referenced.
    listed = filesystem.get_file_info(fs.FileSelector(root, recursive=True, allow_not_found=True))
    referenced = referenced_files(table.refresh())
    cutoff = time.time() - min_age_seconds
    orphans = []
    for info in listed:
        if info.type != fs.FileType.File or info.path in referenced:
            continue
        if info.mtime is None or info.mtime.timestamp() > cutoff:
            continue
        orphans.append(info.path if scheme == "file" else f"{scheme}://{info.path}")
    return orphans


def remove_orphan_files(table: Table, min_age_seconds: float) -> int:
    """Delete :func:`orphan_files`; returns how many."""
    orphans = orphan_files(table, min_age_seconds)
    for location in orphans:
        table.io.delete(location)
    return len(orphans)
