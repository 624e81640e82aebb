"""A flush goes ahead of merges starting in the same process (``run``).

``run`` streams and merges in one interpreter, and only one of its threads runs Python at a time.
Beside four merge lanes a flush of 200 tables' files got about a fifth of it and took 1.7 s instead
of about 0.4 (``bench.tables --modes run``: commit -> staged p99 8.8 s at a 5 s flush interval),
and every change it carried waited that long. While a flush is written, merges do not start their
next table: the flush has the interpreter to itself once the merges in progress end, and the
merges lose no time overall (the same work, in another order).
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
