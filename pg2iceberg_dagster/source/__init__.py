"""Everything that talks to the source PostgreSQL: connections, catalog, replication, pgoutput."""
