"""Iceberg side: catalog access, PostgreSQL to Iceberg type mapping, schema evolution."""
