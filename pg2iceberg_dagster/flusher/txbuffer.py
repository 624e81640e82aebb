"""The open transaction's changes, in memory up to a bound and spilled to a temporary file past it."""

from __future__ import annotations

import pickle
import tempfile
from collections.abc import Iterator
from typing import IO

from ..faults import crash_point
from ..staging.codec import Change, StagedRelation

Entry = tuple[StagedRelation, Change]


def estimate_size(change: Change) -> int:
    """Approximate in-memory size of a change, for the memory and flush bounds."""
    return 96 + sum(len(key) + (len(value) if value else 0) for key, value in change.data.items())


class TransactionBuffer:
    """Holds one transaction's changes until COMMIT; never more than ``memory_bytes`` in memory."""

    def __init__(self, memory_bytes: int, spill_dir: str | None = None) -> None:
        self._memory_bytes = memory_bytes
        self._spill_dir = spill_dir
        self._entries: list[Entry] = []
        self._size = 0
        self._spill: IO[bytes] | None = None
        self.count = 0

    @property
    def spilled(self) -> bool:
        return self._spill is not None

    def add(self, relation: StagedRelation, change: Change) -> None:
        self.count += 1
        if self._spill is not None:
            pickle.dump((relation, change), self._spill, protocol=pickle.HIGHEST_PROTOCOL)
            crash_point("flusher.during_spill")
            return
        self._entries.append((relation, change))
        self._size += estimate_size(change)
        if self._size > self._memory_bytes:
            # Closed by clear(); it outlives this call by design.
            self._spill = tempfile.TemporaryFile(dir=self._spill_dir, prefix="pg2iceberg-txn-")  # noqa: SIM115
            for entry in self._entries:
                pickle.dump(entry, self._spill, protocol=pickle.HIGHEST_PROTOCOL)
            self._entries = []

    def __iter__(self) -> Iterator[Entry]:
        if self._spill is None:
            yield from self._entries
            return
        self._spill.flush()
        self._spill.seek(0)
        while True:
            try:
                yield pickle.load(self._spill)
            except EOFError:
                return

    def clear(self) -> None:
        if self._spill is not None:
            self._spill.close()
        self._spill = None
        self._entries = []
        self._size = 0
        self.count = 0
