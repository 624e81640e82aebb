"""Snapshot summary properties on the commits Spark SQL makes (MERGE INTO, DELETE, INSERT).

Iceberg's Spark runtime takes extra summary properties of a SQL write only from
``org.apache.iceberg.spark.CommitMetadata``: a thread-local map its writes read when they commit, on
the driver thread that runs the statement. PySpark pins each Python thread to a JVM thread, so setting
that map (through reflection: its public ``withCommitProperties`` wants a Java callable) before a
statement and clearing it after stamps exactly that statement's commit, even with merges of other
tables running on other threads of the same session. A session reached through a plain py4j gateway
(a warm driver, see warm_spark.py) has no such pinning: a call may run on any JVM thread, so there
the commits carry no extra properties rather than risk stamping another table's commit.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

log = logging.getLogger(__name__)
_warned = threading.Event()  # said once per process, not at every commit

_COMMIT_METADATA = "org.apache.iceberg.spark.CommitMetadata"
_THREAD_LOCAL_FIELD = "COMMIT_PROPERTIES"
# The holder found per py4j gateway (one per JVM): looking it up takes four reflection calls, which
# every merge and history write would otherwise repeat.
_holders: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def _commit_properties_holder(spark: Any) -> Any | None:
    """The JVM thread-local CommitMetadata reads, or None where it cannot be used safely (a gateway not
    pinned to threads) or reached (Spark Connect, another runtime: a warning says so)."""
    try:
        from py4j.clientserver import ClientServer

        gateway = spark.sparkContext._gateway
        if not isinstance(gateway, ClientServer):
            return None  # not pinned to JVM threads (see the module's docstring)
        if gateway in _holders:
            return _holders[gateway]
        jvm = spark.sparkContext._jvm
        # Through Spark's class loader: the runtime jar comes with spark.jars, not the JVM's class path.
        commit_metadata = jvm.org.apache.spark.util.Utils.classForName(_COMMIT_METADATA, True, False)
        field = commit_metadata.getDeclaredField(_THREAD_LOCAL_FIELD)
        field.setAccessible(True)
        _holders[gateway] = holder = field.get(None)
        return holder
    except Exception as exc:  # py4j raises its own error types; any failure means "not reachable"
        if not _warned.is_set():
            _warned.set()
            log.warning("cannot set Iceberg snapshot summary properties from this Spark session: %s", exc)
        return None


def commit_properties_available(spark: Any) -> bool:
    """Whether Spark SQL commits made on this thread can carry summary properties (see the module's docstring)."""
    return _commit_properties_holder(spark) is not None


@contextlib.contextmanager
def snapshot_properties(spark: Any, properties: Mapping[str, str]) -> Iterator[None]:
    """Add ``properties`` to the summary of the Iceberg commits Spark SQL makes in this block on
    this thread."""
    holder = _commit_properties_holder(spark) if properties else None
    if holder is None:
        yield
        return
    java_map = spark.sparkContext._jvm.java.util.HashMap()
    for key, value in properties.items():
        java_map.put(key, value)
    holder.set(java_map)
    try:
        yield
    finally:
        holder.remove()
