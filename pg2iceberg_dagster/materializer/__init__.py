"""Materializer: fold staged changes by primary key and MERGE them into Iceberg with Spark."""
