"""The Dagster integration of the mirror, installed with the package (``pip install pg2iceberg-dagster``).

Add a mirror to a Dagster project with the component (``dg scaffold defs
pg2iceberg_dagster.dagster_integration.Pg2IcebergComponent mirror``) or in Python::

    from pg2iceberg_dagster.dagster_integration import build_definitions

    defs = build_definitions("pg2iceberg.yaml", name="mirror")

The engine never imports this package; it reaches the engine through ``pg2iceberg_dagster.pipeline``
(plus ``config`` and ``errors``)."""

from .component import Pg2IcebergComponent
from .definitions import build_definitions, mirror_definitions
from .mirror import DEFAULT_NAME, Mirror, table_run_tag
from .resources import Pg2IcebergResource, PostgresResource, SparkResource
from .translator import ROLES, Pg2IcebergTranslator, TableAsset

__all__ = [
    "DEFAULT_NAME",
    "ROLES",
    "Mirror",
    "Pg2IcebergComponent",
    "Pg2IcebergResource",
    "Pg2IcebergTranslator",
    "PostgresResource",
    "SparkResource",
    "TableAsset",
    "build_definitions",
    "mirror_definitions",
    "table_run_tag",
]
