"""WAL flusher: logical replication into the staged log."""
