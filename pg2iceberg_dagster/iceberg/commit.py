"""Iceberg commits under optimistic concurrency: retried when another writer committed first."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from pyiceberg.exceptions import CommitFailedException

T = TypeVar("T")


def commit_with_retry(operation: Callable[[], T], attempts: int = 8) -> T:
    """Run an Iceberg commit, retrying when another writer committed first (optimistic concurrency)."""
    for attempt in range(attempts):
        try:
            return operation()
        except CommitFailedException:
            if attempt == attempts - 1:
                raise
            time.sleep(0.05 * (2**attempt))
    raise AssertionError("unreachable")
