"""The repository's code location, assets: the installed integration's
(``pg2iceberg_dagster.dagster_integration``), and the translator that names them (one place decides
keys, groups, kinds per table)."""

from pg2iceberg_dagster.dagster_integration.assets import table_check_results, table_definitions
from pg2iceberg_dagster.dagster_integration.translator import ROLES, Pg2IcebergTranslator, TableAsset

__all__ = ["ROLES", "Pg2IcebergTranslator", "TableAsset", "table_check_results", "table_definitions"]
