"""The repository's code location, resources: the installed integration's, thin typed wrappers that
hand the engine its configuration and clients."""

from pg2iceberg_dagster.dagster_integration.resources import Pg2IcebergResource, PostgresResource, SparkResource

__all__ = ["Pg2IcebergResource", "PostgresResource", "SparkResource"]
