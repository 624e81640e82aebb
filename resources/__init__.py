"""Dagster resources: thin, typed wrappers that hand the engine its configuration and clients."""

from .pipeline import Pg2IcebergResource, PostgresResource
from .spark import SparkResource

__all__ = ["Pg2IcebergResource", "PostgresResource", "SparkResource"]
