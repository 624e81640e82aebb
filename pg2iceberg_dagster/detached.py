"""Detached helper processes that outlive the process starting them (the snapshot holder, the warm
Spark server). The config goes to them pickled on stdin, exactly as the starting process resolved
it (a password set from a Dagster ``EnvVar``, S3 keys from dagster-aws included): never on the
command line, never on disk, never re-read from a YAML file that lacks those overrides."""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence

from .config import PipelineConfig
from .errors import Pg2IcebergError


def process_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (one of another user's counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def spawn_with_config(argv: Sequence[str], config: PipelineConfig) -> subprocess.Popen[bytes]:
    """Start ``argv`` in a new session with ``config`` on its stdin. Its stderr goes to an unnamed
    temporary file, read by :func:`detached_error` if it exits early."""
    errors = tempfile.TemporaryFile()  # noqa: SIM115 - handed to the child and kept on the Popen
    process = subprocess.Popen(
        list(argv),
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=errors,
        start_new_session=True,
        env=os.environ.copy(),
    )
    assert process.stdin is not None
    with contextlib.suppress(BrokenPipeError):  # a child that died at once says why on stderr
        process.stdin.write(pickle.dumps(config))
    process.stdin.close()
    process.stderr = errors
    return process


def detached_error(process: subprocess.Popen[bytes]) -> str:
    """What a process started by :func:`spawn_with_config` wrote to its stderr."""
    if process.stderr is None:
        return ""
    process.stderr.seek(0)
    return process.stderr.read().decode(errors="replace").strip()


def run_detached(work: Callable[[PipelineConfig, threading.Event], object]) -> int:
    """The body of a detached process: ``work(config, stop)`` with the config its starter sent on
    stdin; SIGTERM and SIGINT set ``stop``. Returns the process's exit code."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = pickle.load(sys.stdin.buffer)
    if not isinstance(config, PipelineConfig):
        print("error: stdin did not carry a pipeline config", file=sys.stderr)
        return 2
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    try:
        work(config, stop)
    except Pg2IcebergError as exc:  # its starter shows this stderr: the message, not a traceback
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0
