"""pg2iceberg-dagster replication engine."""
