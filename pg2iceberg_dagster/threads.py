"""Work run in a thread of its own while a block runs, stopped and joined when the block ends."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def alongside(
    work: Callable[[threading.Event], object], name: str
) -> Iterator[tuple[threading.Event, list[BaseException]]]:
    """``work(stop)`` in a daemon thread named ``name`` while the block runs. Yields ``stop`` and the
    list that receives what ``work`` raised (complete once the block is left); on leaving, ``stop``
    is set and the thread joined."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            work(stop)
        except BaseException as exc:  # the caller decides: raise it, or look at it
            errors.append(exc)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    try:
        yield stop, errors
    finally:
        stop.set()
        thread.join()
