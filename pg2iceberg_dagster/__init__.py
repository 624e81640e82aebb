"""pg2iceberg-dagster replication engine.

``Pg2IcebergComponent`` and ``build_definitions`` (the Dagster integration, in ``dagster_integration``)
are importable from here too, loaded on first use: importing the engine never imports Dagster."""

from typing import Any

_INTEGRATION = ("Pg2IcebergComponent", "build_definitions")


def __getattr__(name: str) -> Any:
    if name in _INTEGRATION:
        from . import dagster_integration

        return getattr(dagster_integration, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
