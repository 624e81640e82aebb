"""The detached holder process that :func:`~.holder.spawn_holder` starts (its config on stdin: see
:mod:`pg2iceberg_dagster.detached`)."""

from __future__ import annotations

import sys

from ..detached import run_detached
from .holder import hold_snapshot


def main(argv: list[str]) -> int:
    """``python -m pg2iceberg_dagster.snapshot.holder_process MAX_SECONDS`` with the config on stdin.
    SIGTERM lets go of the snapshot and withdraws its advertisement."""
    return run_detached(lambda config, stop: hold_snapshot(config, stop, max_seconds=float(argv[0])))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
