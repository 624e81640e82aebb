"""The detached warm Spark server that :func:`~.warm_spark.warm_session` starts (its config on
stdin: see :mod:`pg2iceberg_dagster.detached`)."""

from __future__ import annotations

import sys

from ..detached import run_detached
from .warm_spark import serve

if __name__ == "__main__":
    sys.exit(run_detached(serve))
