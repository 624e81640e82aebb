"""Named crash points for fault-injection runs: the process really dies there, as a crash would.

``PG2ICEBERG_CRASH_AT=point`` (or ``point:N`` for the Nth time the point is reached, default the
first) makes the process SIGKILL itself at that point: no ``finally``, no ``atexit``, no flush, so
what survives is exactly what a power cut or an OOM kill would leave. Unset, a crash point costs a
dictionary lookup. The points are listed in ``CRASH_POINTS``; an unknown name is refused at startup so
a typo cannot turn a fault run into a run without faults.
"""

from __future__ import annotations

import os
import signal

CRASH_ENV = "PG2ICEBERG_CRASH_AT"

CRASH_POINTS: dict[str, str] = {
    "snapshot.mid_chunk": "a chunk is read but its Iceberg commit has not happened",
    "snapshot.after_chunk_commit": "a chunk is in Iceberg but not recorded as done",
    "flusher.mid_transaction": "a transaction is half buffered",
    "flusher.during_spill": "a large transaction is being spilled to disk",
    "flusher.after_upload": "staged files are uploaded but not registered",
    "flusher.after_register": "staged files are registered but the slot was not acknowledged",
    "materializer.after_fill": "a column's DEFAULT is set on existing rows but the fill is not marked done",
    "materializer.before_fast_forward": "a batch is written on the merge branch but main is not moved to it",
    "materializer.before_history": "the MERGE is committed to Iceberg but the history table's versions are not",
    "materializer.after_commit": "the MERGE is committed to Iceberg but mat_cursor is not advanced",
    "resync.before_switch": "a resync's copy is written but not switched in",
    "resync.after_switch": "a resync is switched in Iceberg but not recorded as finished",
    "repair.after_slot_dropped": "a lost slot's repair marked the tables and dropped the slot, no new slot yet",
    "repair.after_slot_created": "a lost slot's repair created the new slot but repaired no table yet",
    "repair.before_commit": "a table's differences are gathered but not written to Iceberg",
    "repair.after_commit": "a table's differences are written to Iceberg but the repair is not recorded as done",
    "maintenance.after_compaction": "a table's files are compacted but its snapshots not expired",
    "maintenance.after_expiry": "a table's snapshots are expired but its orphan files not removed",
}


def _parse(spec: str | None) -> tuple[str, int] | None:
    if not spec:
        return None
    name, _, count = spec.partition(":")
    if name not in CRASH_POINTS:
        raise ValueError(f"{CRASH_ENV}={spec!r}: unknown crash point; known points: {', '.join(CRASH_POINTS)}")
    if count and (not count.isdigit() or int(count) < 1):
        raise ValueError(f"{CRASH_ENV}={spec!r}: the count after ':' must be a positive integer")
    return name, int(count or 1)


_armed = _parse(os.environ.get(CRASH_ENV))
_hits: dict[str, int] = {}


def armed(name: str) -> bool:
    """Whether this run may die at crash point ``name`` (a hot loop skips its calls when not)."""
    return _armed is not None and _armed[0] == name


def crash_point(name: str) -> None:
    """Die here (SIGKILL) when this point is armed and reached for the armed number of times."""
    if _armed is None or _armed[0] != name:
        return
    _hits[name] = _hits.get(name, 0) + 1
    if _hits[name] >= _armed[1]:
        os.kill(os.getpid(), signal.SIGKILL)
