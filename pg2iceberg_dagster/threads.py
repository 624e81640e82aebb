"""Threads beside the caller: work run alongside a block, and a resource of each worker thread's own."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

Resource = TypeVar("Resource")


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


class PerThread(Generic[Resource]):
    """A resource of each thread's own (a connection, say), opened on the thread's first call."""

    def __init__(self, open_resource: Callable[[], Resource]) -> None:
        self._open_resource = open_resource
        self._local = threading.local()
        self._opened: list[Resource] = []
        self._lock = threading.Lock()

    def __call__(self) -> Resource:
        resource: Resource | None = getattr(self._local, "resource", None)
        if resource is None:
            resource = self._local.resource = self._open_resource()
            with self._lock:
                self._opened.append(resource)
        return resource

    def opened(self) -> list[Resource]:
        """Every resource opened so far, whichever thread opened it (not those discarded)."""
        with self._lock:
            return list(self._opened)

    def discard(self) -> Resource | None:
        """Forget this thread's resource (it failed, say) and return it for the caller to close; the
        thread's next call opens a new one."""
        resource: Resource | None = getattr(self._local, "resource", None)
        self._local.resource = None
        if resource is not None:
            with self._lock:
                self._opened.remove(resource)
        return resource


@contextmanager
def per_thread(
    open_resource: Callable[[], Resource], close_resource: Callable[[Resource], None]
) -> Iterator[PerThread[Resource]]:
    """A :class:`PerThread` of ``open_resource``; every resource it opened is closed on leaving (once
    the threads using them are done)."""
    resources = PerThread(open_resource)
    try:
        yield resources
    finally:
        for resource in resources.opened():
            close_resource(resource)
