"""Coordination store: the _pg2iceberg schema, its migrations and its queries."""
