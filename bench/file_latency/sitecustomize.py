"""Loaded by the benches' children when ``PG2ICEBERG_BENCH_FILE_LATENCY_MS`` is set (``bench.tables
--file-latency-ms``): each Iceberg file pyiceberg creates (data, manifest, manifest list, metadata)
waits that long first, the interpreter released, as an object store's PUT round trip would. Local
files cost microseconds, so without it a bench cannot show what waits on object storage cost."""

import os
import time

_LATENCY_MS = float(os.environ.get("PG2ICEBERG_BENCH_FILE_LATENCY_MS") or 0)

if _LATENCY_MS > 0:
    from pyiceberg.io.pyarrow import PyArrowFile

    _create = PyArrowFile.create

    def _create_after_a_round_trip(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        time.sleep(_LATENCY_MS / 1000)
        return _create(self, *args, **kwargs)

    PyArrowFile.create = _create_after_a_round_trip  # type: ignore[method-assign]
