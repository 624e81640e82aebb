"""Staged log: the staging codec and the object store the Parquet files live in."""
