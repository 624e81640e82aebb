"""The detached holder process that :func:`~.holder.spawn_holder` starts.

Its config arrives pickled on stdin, exactly as the starting process resolved it (a password set from
a Dagster ``EnvVar``, S3 keys from dagster-aws included): never on the command line, never on disk,
never re-read from a YAML file that lacks those overrides.
"""

from __future__ import annotations

import logging
import pickle
import signal
import sys
import threading

from ..config import PipelineConfig
from .holder import hold_snapshot


def main(argv: list[str]) -> int:
    """``python -m pg2iceberg_dagster.snapshot.holder_process MAX_SECONDS`` with the config on stdin."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = pickle.load(sys.stdin.buffer)
    if not isinstance(config, PipelineConfig):
        print("error: stdin did not carry a pipeline config", file=sys.stderr)
        return 2
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())  # let go of the snapshot and withdraw its advertisement
    hold_snapshot(config, stop, max_seconds=float(argv[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
