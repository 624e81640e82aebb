"""The repository's own code location (the quickstart's deployment): one mirror, built by the installed
integration (`pg2iceberg_dagster.dagster_integration`) from one pipeline config.

The config is ``$PG2ICEBERG_CONFIG``; without it, the quickstart's ``.pg2iceberg/pg2iceberg.yaml`` once
``pg2iceberg-dagster quickstart`` wrote it, else ``examples/pg2iceberg.yaml`` (a graph to look at: its
hosts are examples). Loading writes nothing. Secrets stay in the environment: the config names the
variables; ``PostgresResource`` takes EnvVar.
"""

from __future__ import annotations

import os
from pathlib import Path

from pg2iceberg_dagster.dagster_integration.definitions import build_definitions

ROOT = Path(__file__).parent
QUICKSTART_CONFIG = ROOT / ".pg2iceberg" / "pg2iceberg.yaml"
EXAMPLE_CONFIG = ROOT / "examples" / "pg2iceberg.yaml"


def config_path() -> Path:
    """The pipeline config this code location mirrors."""
    configured = os.environ.get("PG2ICEBERG_CONFIG")
    if configured:
        return Path(configured)
    return QUICKSTART_CONFIG if QUICKSTART_CONFIG.exists() else EXAMPLE_CONFIG


defs = build_definitions(config_path())
