"""The open transaction's row messages past ``flush.txn_memory_bytes``: on disk until COMMIT.

A transaction is only known to be wanted at its COMMIT, and it may be larger than memory, so past the
bound its messages (whole WAL data messages, as received) go to a temporary file, and COMMIT reads
them back in bounded chunks.
"""

from __future__ import annotations

import contextlib
import struct
import tempfile
from collections.abc import Iterator

from ..errors import StagingError
from ..faults import crash_point

# A spilled entry: the message's length, then the message.
_ENTRY = struct.Struct("!I")


class SpillFile:
    """Row messages of one transaction in a temporary file (removed by :meth:`close`)."""

    def __init__(self, spill_dir: str | None = None) -> None:
        self._dir = spill_dir or tempfile.gettempdir()
        try:
            # Closed by close(); it outlives this call by design.
            self._file = tempfile.TemporaryFile(dir=spill_dir, prefix="pg2iceberg-txn-")  # noqa: SIM115
        except OSError as exc:
            raise self._failed(exc) from exc
        self.count = 0

    def _failed(self, exc: OSError) -> StagingError:
        return StagingError(
            f"cannot spill a large transaction to {self._dir} ({exc.strerror or exc}); free space there or point "
            "flush.spill_dir at a larger disk"
        )

    def add(self, message: bytes | bytearray) -> None:
        try:
            self._file.write(_ENTRY.pack(len(message)))
            self._file.write(message)
        except OSError as exc:
            raise self._failed(exc) from exc
        self.count += 1
        crash_point("flusher.during_spill")

    def chunks(self, max_rows: int, max_bytes: int) -> Iterator[list[bytes]]:
        """The messages in order, at most ``max_rows`` and about ``max_bytes`` at a time."""
        try:
            self._file.flush()
        except OSError as exc:
            raise self._failed(exc) from exc
        self._file.seek(0)
        messages: list[bytes] = []
        size = 0
        while header := self._file.read(_ENTRY.size):
            (length,) = _ENTRY.unpack(header)
            messages.append(self._file.read(length))
            size += length
            if len(messages) >= max_rows or size >= max_bytes:
                yield messages
                messages, size = [], 0
        if messages:
            yield messages

    def close(self) -> None:
        """Remove the file. Never raises: a full disk already failed the write that matters, and a
        second ENOSPC from the buffered flush here would hide that first error."""
        with contextlib.suppress(OSError):
            self._file.close()
