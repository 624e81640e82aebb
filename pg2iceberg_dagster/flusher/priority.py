"""A flush goes ahead of merges starting in the same process (``run``).

``run`` streams and merges in one interpreter, and only one of its threads runs Python at a time.
Beside four merge lanes a flush of 200 tables' files took 1.55 s at the median (``bench.tables
--modes run``), and every change it carried waited that long. While a flush is written, merges do
not start their next table: the flush has the interpreter to itself once the merges in progress
end (0.48 s at the median in the same bench: commit -> staged p99 6.3 s from 8.9), and the merges
do the same work in another order.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

# A flush that takes longer (a large transaction, a slow object store) holds merges back no longer:
# they would otherwise wait out its whole upload.
MAX_WAIT_SECONDS = 2.0


class FlushFirst:
    """Held by the flusher while it writes a flush (:meth:`flushing`); merges call :meth:`wait`
    before each table."""

    def __init__(self, max_wait: float = MAX_WAIT_SECONDS) -> None:
        self._max_wait = max_wait
        self._idle = threading.Event()
        self._idle.set()
        self._began = 0.0

    @contextmanager
    def flushing(self) -> Iterator[None]:
        """A flush is being written for the duration."""
        self._began = time.monotonic()
        self._idle.clear()
        try:
            yield
        finally:
            self._idle.set()

    def wait(self) -> None:
        """Return once no flush is being written, or the one being written began ``max_wait`` ago."""
        if not self._idle.is_set():
            self._idle.wait(max(0.0, self._began + self._max_wait - time.monotonic()))
