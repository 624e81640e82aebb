"""Dagster assets generated from the pipeline config: one set per configured table."""

from .tables import table_definitions
from .translator import Pg2IcebergTranslator

__all__ = ["Pg2IcebergTranslator", "table_definitions"]
